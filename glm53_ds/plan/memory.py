"""One rank's whole memory at a layout, and the smallest layouts that fit a GPU.

    total = training state (state.py: exact counts of the model built on meta)
          + activations at their peak (activations.py: measured per layer kind on meta, composed over the model)
          + communication buffers (ZeRO's gradient-reduction buckets)

and a run fits when the total leaves `RESERVE_FRACTION` of the GPU free: the CUDA context, NCCL's buffers and the
caching allocator's fragmentation are not modelled (together typically 2-8% of an 80-141 GB GPU).

Communication buffers, as `glm53_ds.build_engine` configures DeepSpeed 0.19.8 on GPUs (contiguous_gradients and
overlap_comm on; reduce_bucket_size left at its default of 5e8 elements): ZeRO 1 / 2 hold two reduction buckets of
that size in the training dtype (double-buffered for the overlap), stage 0 flattens up to one bucket at a time. The
expert-parallel all-to-all buffers are activations (the trace sees them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..parallel import init_layout
from ..parallel.layout import validate_layout
from .activations import MTP_KIND, ActivationProfile, layer_kinds, plan_activations
from .counts import ParameterCounts, count_parameters
from .dry_run import UntraceableLayout, fake_world
from .network import micro_batches
from .run import LOSS_CHUNK_MIB, PlannedRun
from .state import StateBytes, host_state_split, state_bytes

REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed 0.19.8's default reduce_bucket_size (elements)
RESERVE_FRACTION = 0.08  # of the GPU, left for the CUDA context, NCCL and allocator fragmentation
RECOMPUTE_ORDER = ("none", "selective", "full")  # cheapest first: what --search prefers


def communication_bytes(zero_stage: int, bf16: bool, overlap_comm: bool = True) -> int:
    """ZeRO's gradient-reduction buckets (see the module docstring)."""
    buckets = 2 if zero_stage >= 1 and overlap_comm else 1
    return buckets * REDUCE_BUCKET_ELEMENTS * (2 if bf16 else 4)


@dataclass
class RankMemory:
    """One rank's memory in a run (bytes)."""

    run: PlannedRun
    state: StateBytes
    activations: int  # the step's activation peak (composed over the model)
    activations_saved: int  # of which kept from the forward for backward
    # the loss head's backward above what the forward kept (its fp32 logit chunks, the head's weight gradient)
    loss_head: int
    communication: int
    gpu: int
    # layer kind -> its layers, bytes kept per layer, backward peak above the layers below
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    host: int = 0  # pinned host memory of this rank (--offload-activations: every layer's kept inputs)
    host_state: int = 0  # pinned host memory of this rank's optimizer state (--offload-optimizer cpu)
    host_state_pageable: int = 0  # and pageable (its Adam moments)

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.communication

    @property
    def fits(self) -> bool:
        return self.total <= (1 - RESERVE_FRACTION) * self.gpu

    def as_dict(self) -> dict[str, Any]:
        return dict(layout=self.run.layout_dict(), state=self.state.as_dict(), activations=self.activations,
                    activations_saved=self.activations_saved, loss_head=self.loss_head,
                    communication=self.communication, total=self.total, gpu_memory=self.gpu, fits=self.fits,
                    activations_by_kind=self.by_kind, host_memory=self.host, host_state=self.host_state,
                    host_state_pageable=self.host_state_pageable)  # fmt: skip


def rank_memory(
    run: PlannedRun, counts: ParameterCounts | None = None, profile: ActivationProfile | None = None
) -> RankMemory:
    """The memory of one rank of `run` (`counts`: the rank's parameters at its EP x ETP; `profile`: its
    activations; each computed here when not given, the trace first: it joins the layout's fake world, in which
    the planner's meta builds run too)."""
    if profile is None:
        profile = plan_activations(run)
    if counts is None:
        counts = count_parameters(run)
    c = run.config
    offload = c.offload_optimizer == "cpu"
    state = state_bytes(counts, run.world, c.ep, c.etp, run.zero, bf16=run.bf16, offload=offload)
    accumulating = micro_batches(run) > 1
    pinned, pageable = (
        host_state_split(counts, run.world, c.ep, c.etp, run.bf16, run.zero, accumulating)
        if offload
        else (0, 0)
    )
    kinds = layer_kinds(run.model)
    by_kind = {
        kind: {"layers": kinds.count(kind) if kind != MTP_KIND else profile.mtp_layers,
               "saved_per_layer": unit.saved, "backward_peak": unit.backward_peak}
        for kind, unit in profile.units.items()
    }  # fmt: skip
    return RankMemory(run, state, profile.peak(kinds), profile.saved(kinds), profile.head_backward_peak,
                      communication_bytes(run.zero, run.bf16), run.gpu, by_kind, profile.host_saved(kinds),
                      host_state=pinned, host_state_pageable=pageable)  # fmt: skip


HOST_RESERVE_FRACTION = 0.10  # of --host-memory, kept for the system, the data workers and the page cache


def host_per_node(memory: RankMemory, gpus_per_node: int) -> int:
    """Host memory the ranks of one node hold (pinned and pageable: the offloaded optimizer state, the layers'
    kept inputs under --offload-activations)."""
    per_rank = memory.host + memory.host_state + memory.host_state_pageable
    return per_rank * min(gpus_per_node, memory.run.world)


def host_fits(memory: RankMemory, host_bytes: int, gpus_per_node: int) -> bool:
    return host_per_node(memory, gpus_per_node) <= (1 - HOST_RESERVE_FRACTION) * host_bytes


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


@dataclass
class SearchResult:
    world: int  # the smallest world where a layout fits (0: none)
    fitting: list[RankMemory]  # up to `show` of its layouts, the cheapest first
    nearest: RankMemory | None = None  # when nothing fits: the layout that came closest (least memory)
    not_planned: list[str] = field(default_factory=list)  # why untraceable layouts were skipped


WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)


def search(
    run: PlannedRun, worlds: tuple[int, ...] = WORLDS, zero_stages: tuple[int, ...] = (1, 2),
    recompute_modes: tuple[str, ...] = RECOMPUTE_ORDER, max_sp: int = 16, max_etp: int = 8, show: int = 10,
    progress: Callable[[str], None] | None = None, host_bytes: int | None = None, gpus_per_node: int = 8,
) -> SearchResult:  # fmt: skip
    """The smallest world (of `worlds`, in GPUs) at which a variant of `run` fits, and up to `show` variants that
    fit there, the cheapest first: less recompute, less SP, less ETP, then less memory; when nothing fits, the
    nearest miss. The variants differ from `run` in the options declared searched (training/config.py: the world,
    EP, ETP, SP, recompute and activation offload) and the ZeRO stage; every other option (the model, the length,
    LoRA, tiles, the loss head, the losses) is the run's. With the indexer loss, full recompute is not a layout
    (the trainer refuses it). `progress`: called with one line per world searched. An EP x ETP whose ranks the meta
    trace cannot follow (`UntraceableLayout`) is skipped, its reason in `not_planned`.

    Layouts: EP, ETP and SP powers of two that divide the experts, their FFN width, the heads and the length (EP
    may span the SP ranks: the world divisible by ETP x SP and by ETP x EP); ZeRO 1 and 2; each recompute mode,
    and full recompute with the kept layer inputs offloaded to the host (the last resort: it moves them over PCIe
    twice per step). A layout whose training state alone does not fit is not traced; the others' activations are
    traced once per EP x ETP x SP x recompute x offload (EP matters: the backward holds the local experts' weight
    gradients for a moment). `host_bytes`: one node's host memory (`gpus_per_node` ranks per node): a layout whose
    host does not hold what its ranks put there (`host_fits`) does not fit either."""
    cfg, seq_length = run.model, run.config.seq_length
    offload = run.config.offload_optimizer == "cpu"
    usable = (1 - RESERVE_FRACTION) * run.gpu
    fake_world(1)  # the counts' meta builds need a world and megatron's state; each trace sets its layout's
    init_layout(1, 1, cfg)
    if run.trains_indexer:
        recompute_modes = tuple(mode for mode in recompute_modes if mode != "full")
    variants = [(mode, False) for mode in recompute_modes] + (
        [("full", True)] if "full" in recompute_modes else []
    )
    profiles: dict[tuple[int, int, int, str, bool], ActivationProfile] = {}
    count_cache: dict[tuple[int, int], ParameterCounts] = {}
    nearest: RankMemory | None = None
    untraceable: dict[tuple[int, int], str] = {}  # (EP, ETP): why a trace of its ranks cannot run
    for world in worlds:
        fitting = []
        traced = 0
        for etp, sp, ep in itertools.product(_powers_of_two(max_etp), _powers_of_two(max_sp),
                                             _powers_of_two(cfg.n_routed_experts)):  # fmt: skip
            try:
                validate_layout(world, ep, etp, cfg, sp=sp, seq_length=seq_length)
            except ValueError:
                continue
            layout = run.variant(gpus=world, ep=ep, etp=etp, sp=sp)
            if (ep, etp) not in count_cache:
                count_cache[(ep, etp)] = count_parameters(layout)
            counts = count_cache[(ep, etp)]
            for zero in zero_stages:
                if (ep, etp) in untraceable:
                    break
                state = state_bytes(counts, world, ep, etp, zero, bf16=run.bf16, offload=offload)
                if state.total + communication_bytes(zero, run.bf16) > usable:
                    continue
                if offload and host_bytes is not None:  # the host's optimizer state alone, before any trace
                    on_host = sum(host_state_split(counts, world, ep, etp, run.bf16, zero))
                    if on_host * min(gpus_per_node, world) > (1 - HOST_RESERVE_FRACTION) * host_bytes:
                        continue
                for recompute, offload in variants:
                    candidate = layout.variant(zero=zero, recompute=recompute, offload_activations=offload)
                    key = (ep, etp, sp, recompute, offload)
                    if key not in profiles:
                        try:
                            profiles[key] = plan_activations(candidate)
                        except UntraceableLayout as e:  # skipped and said, not the end of the search
                            untraceable[(ep, etp)] = str(e)
                            break
                    memory = rank_memory(candidate, counts, profiles[key])
                    traced += 1
                    if memory.fits and (host_bytes is None or host_fits(memory, host_bytes, gpus_per_node)):
                        fitting.append(memory)
                        break  # more recompute or offload at the same layout only costs
                    elif nearest is None or memory.total < nearest.total:
                        nearest = memory
        if progress is not None:
            progress(f"{world} GPUs: {traced} layouts traced, {len(fitting)} fit")
        if fitting:
            fitting.sort(key=lambda m: (variants.index((m.run.config.recompute, m.run.config.offload_activations)),
                                        m.run.config.sp, m.run.config.etp, m.total))  # fmt: skip
            return SearchResult(world, fitting[:show], not_planned=list(untraceable.values()))
    return SearchResult(0, [], nearest, list(untraceable.values()))


def what_would_fit(memory: RankMemory) -> list[str]:
    """For a run that does not fit: each single change that makes it fit (more recompute, ZeRO 2, SP, twice the
    GPUs at the same EP x ETP, half the row, activation offload under full recompute, the default loss chunk where
    the run materialises its logits or takes larger chunks), else each pair (full recompute with SP, with twice the
    GPUs, or with activation offload), as a line naming the trainer's flags and the total it gives. With the
    indexer loss, no change to full recompute (the trainer refuses it)."""
    run = memory.run
    c = run.config
    full = run.variant(recompute="full", zero=max(run.zero, 1))
    singles: list[tuple[str, PlannedRun]] = [
        (f"--recompute {mode}", run.variant(recompute=mode))
        for mode in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(c.recompute) + 1 :]
    ]
    if run.zero < 2:
        singles.append(("ZeRO 2 (ds_configs/zero2_bf16.json)", run.variant(zero=2)))
    singles += [(f"--sp {sp}", run.variant(sp=sp)) for sp in (2 * c.sp, 4 * c.sp)]
    singles.append((f"{2 * run.world} GPUs", run.variant(gpus=2 * run.world)))
    singles.append((f"--seq-length {c.seq_length // 2}", run.variant(seq_length=c.seq_length // 2)))
    # materialised logits or larger chunks than the default
    if c.loss_chunk_mib == 0 or c.loss_chunk_mib > LOSS_CHUNK_MIB:
        singles.append((f"--loss-chunk-mib {LOSS_CHUNK_MIB}", run.variant(loss_chunk_mib=LOSS_CHUNK_MIB)))
    if c.recompute == "full" and not c.offload_activations:
        singles.append(("--offload-activations", run.variant(offload_activations=True)))
    pairs: list[tuple[str, PlannedRun]] = [
        (f"--recompute full --sp {sp}", full.variant(sp=sp)) for sp in (2 * c.sp, 4 * c.sp, 8 * c.sp)
    ]
    pairs.append((f"--recompute full and {2 * run.world} GPUs", full.variant(gpus=2 * run.world)))
    if not c.offload_activations:
        pairs.append(("--recompute full --offload-activations", full.variant(offload_activations=True)))
    for tries in (singles, pairs):
        found = []
        for label, candidate in tries:
            cc = candidate.config
            if run.trains_indexer and cc.recompute == "full":
                continue  # the trainer refuses the indexer loss under full recompute
            try:
                validate_layout(candidate.world, cc.ep, cc.etp, run.model, sp=cc.sp, seq_length=cc.seq_length)
            except ValueError:
                continue
            total = rank_memory(candidate)
            if total.fits:
                found.append(f"{label}: {total.total / 2**30:.1f} GiB")
        if found:
            return found
    return []
