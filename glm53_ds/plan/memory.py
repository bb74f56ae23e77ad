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

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import Glm53Config
from ..parallel import init_layout
from ..parallel.layout import validate_layout
from .activations import MTP_KIND, ActivationProfile, layer_kinds, plan_activations
from .counts import ParameterCounts, count_parameters
from .dry_run import LOSS_CHUNK_MIB, UntraceableLayout, fake_world
from .state import StateBytes, state_bytes

REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed 0.19.8's default reduce_bucket_size (elements)
RESERVE_FRACTION = 0.08  # of the GPU, left for the CUDA context, NCCL and allocator fragmentation
RECOMPUTE_ORDER = ("none", "selective", "full")  # cheapest first: what --search prefers


def communication_bytes(zero_stage: int, bf16: bool, overlap_comm: bool = True) -> int:
    """ZeRO's gradient-reduction buckets (see the module docstring)."""
    buckets = 2 if zero_stage >= 1 and overlap_comm else 1
    return buckets * REDUCE_BUCKET_ELEMENTS * (2 if bf16 else 4)


@dataclass
class Layout:
    world: int
    ep: int
    etp: int
    sp: int
    zero: int
    recompute: str
    offload_activations: bool = False  # full recompute's kept layer inputs in host memory
    moe_tile_mib: int = 0  # the MoE over tiles of tokens (0: untiled)
    # the loss head's chunk of fp32 logits (0: materialised [tokens, vocab] logits)
    loss_chunk_mib: int = LOSS_CHUNK_MIB

    def __str__(self) -> str:
        return (f"world {self.world}: EP {self.ep} x ETP {self.etp} x SP {self.sp}, ZeRO {self.zero}, "
                f"recompute {self.recompute}{', activations offloaded' if self.offload_activations else ''}"
                f"{f', MoE tiles of {self.moe_tile_mib} MiB' if self.moe_tile_mib else ''}"
                f"{'' if self.loss_chunk_mib == LOSS_CHUNK_MIB else f', {self._loss_head()}'}")  # fmt: skip

    def _loss_head(self) -> str:
        return (f"loss chunks of {self.loss_chunk_mib} MiB" if self.loss_chunk_mib > 0
                else "materialised logits")  # fmt: skip

    def deepspeed_config(self, bf16: bool = True) -> str:
        """The shipped DeepSpeed config of this ZeRO stage and dtype (ds_configs/)."""
        if bf16 and self.zero in (1, 2):
            return f"ds_configs/zero{self.zero}_bf16.json"
        return (
            "ds_configs/cpu.json"
            if self.zero == 0 and not bf16
            else f"<a ZeRO-{self.zero} {'bf16' if bf16 else 'fp32'} config>"
        )

    def trainer_flags(self, bf16: bool = True) -> str:
        """The layout as `deepspeed launch/train.py` takes it (world: the launcher's GPUs)."""
        return (f"--ep {self.ep} --etp {self.etp} --sp {self.sp} --recompute {self.recompute} "
                f"{'--offload-activations ' if self.offload_activations else ''}"
                f"{f'--moe-tile-mib {self.moe_tile_mib} ' if self.moe_tile_mib else ''}"
                f"{'' if self.loss_chunk_mib == LOSS_CHUNK_MIB else f'--loss-chunk-mib {self.loss_chunk_mib} '}"
                f"--deepspeed_config {self.deepspeed_config(bf16)}")  # fmt: skip

    def config_section(self, bf16: bool = True) -> str:
        """The layout as a `--config` file's sections (TOML)."""
        return (f"[parallelism]\nep = {self.ep}\netp = {self.etp}\nsp = {self.sp}\n"
                f"[model]\nrecompute = \"{self.recompute}\"\n"
                f"{'offload_activations = true' + chr(10) if self.offload_activations else ''}"
                f"{f'moe_tile_mib = {self.moe_tile_mib}' + chr(10) if self.moe_tile_mib else ''}"
                f"{'' if self.loss_chunk_mib == LOSS_CHUNK_MIB else f'loss_chunk_mib = {self.loss_chunk_mib}' + chr(10)}"
                f"[deepspeed]\ndeepspeed_config = \"{self.deepspeed_config(bf16)}\"")  # fmt: skip


@dataclass
class RankMemory:
    """One rank's memory at a layout (bytes)."""

    layout: Layout
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

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.communication

    @property
    def fits(self) -> bool:
        return self.total <= (1 - RESERVE_FRACTION) * self.gpu

    def as_dict(self) -> dict[str, Any]:
        return dict(layout=asdict(self.layout), state=self.state.as_dict(), activations=self.activations,
                    activations_saved=self.activations_saved, loss_head=self.loss_head,
                    communication=self.communication, total=self.total, gpu_memory=self.gpu, fits=self.fits,
                    activations_by_kind=self.by_kind, host_memory=self.host)  # fmt: skip


def rank_memory(
    cfg: Glm53Config, layout: Layout, seq_length: int, micro_batch: int, gpu: int,
    counts: ParameterCounts | None = None, bf16: bool = True, lora_rank: int = 0,
    profile: ActivationProfile | None = None, indexer_loss_coef: float = 0.0,
) -> RankMemory:  # fmt: skip
    """The memory of one rank of `layout` (`counts`: the rank's parameters at its EP x ETP; `profile`: its
    activations; each computed here when not given, the trace first: it joins the layout's fake world, in which
    the planner's meta builds run too)."""
    if profile is None:
        profile = plan_activations(cfg, seq_length, micro_batch, layout.ep, layout.etp, layout.sp,
                                   layout.recompute, lora_rank, layout.offload_activations,
                                   layout.moe_tile_mib, layout.loss_chunk_mib, indexer_loss_coef)  # fmt: skip
    if counts is None:
        counts = count_parameters(cfg, layout.ep, layout.etp, lora_rank=lora_rank,
                                  mtp=cfg.num_nextn_predict_layers > 0,
                                  train_indexer=indexer_loss_coef > 0)  # fmt: skip
    state = state_bytes(counts, layout.world, layout.ep, layout.etp, layout.zero, bf16=bf16)
    kinds = layer_kinds(cfg)
    by_kind = {
        kind: {"layers": kinds.count(kind) if kind != MTP_KIND else profile.mtp_layers,
               "saved_per_layer": unit.saved, "backward_peak": unit.backward_peak}
        for kind, unit in profile.units.items()
    }  # fmt: skip
    return RankMemory(layout, state, profile.peak(kinds), profile.saved(kinds), profile.head_backward_peak,
                      communication_bytes(layout.zero, bf16), gpu, by_kind, profile.host_saved(kinds))  # fmt: skip


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
    cfg: Glm53Config, seq_length: int, micro_batch: int, gpu: int, bf16: bool = True, lora_rank: int = 0,
    worlds: tuple[int, ...] = WORLDS, zero_stages: tuple[int, ...] = (1, 2),
    recompute_modes: tuple[str, ...] = RECOMPUTE_ORDER, max_sp: int = 16, max_etp: int = 8, show: int = 10,
    progress: Callable[[str], None] | None = None, loss_chunk_mib: int = LOSS_CHUNK_MIB,
    indexer_loss_coef: float = 0.0,
) -> SearchResult:  # fmt: skip
    """The smallest world (of `worlds`, in GPUs) at which some layout fits, and up to `show` layouts that fit
    there, the cheapest first: less recompute, less SP, less ETP, then less memory; when nothing fits, the nearest
    miss. `progress`: called with one line per world searched. `loss_chunk_mib`, `indexer_loss_coef`: the run's
    loss head and indexer loss (kept in every layout, not searched; with the indexer loss, full recompute is not a
    layout: the trainer refuses it). An EP x ETP whose ranks the meta trace cannot follow (`UntraceableLayout`) is
    skipped, its reason in `not_planned`.

    Layouts: EP, ETP and SP powers of two that divide the experts, their FFN width, the heads and the length (EP
    may span the SP ranks: the world divisible by ETP x SP and by ETP x EP); ZeRO 1 and 2; each recompute mode,
    and full recompute with the kept layer inputs offloaded to the host (the last resort: it moves them over PCIe
    twice per step). A layout whose training state alone does not fit is not traced; the others' activations are
    traced once per EP x ETP x SP x recompute x offload (EP matters: the backward holds the local experts' weight
    gradients for a moment)."""
    mtp = cfg.num_nextn_predict_layers > 0
    usable = (1 - RESERVE_FRACTION) * gpu
    fake_world(1)  # the counts' meta builds need a world and megatron's state; each trace sets its layout's
    init_layout(1, 1, cfg)
    if indexer_loss_coef > 0:
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
            if (ep, etp) not in count_cache:
                count_cache[(ep, etp)] = count_parameters(cfg, ep, etp, lora_rank=lora_rank, mtp=mtp,
                                                          train_indexer=indexer_loss_coef > 0)  # fmt: skip
            counts = count_cache[(ep, etp)]
            for zero in zero_stages:
                if (ep, etp) in untraceable:
                    break
                state = state_bytes(counts, world, ep, etp, zero, bf16=bf16)
                if state.total + communication_bytes(zero, bf16) > usable:
                    continue
                for recompute, offload in variants:
                    key = (ep, etp, sp, recompute, offload)
                    if key not in profiles:
                        try:
                            profiles[key] = plan_activations(cfg, seq_length, micro_batch, ep, etp, sp, recompute,
                                                             lora_rank, offload_activations=offload,
                                                             loss_chunk_mib=loss_chunk_mib,
                                                             indexer_loss_coef=indexer_loss_coef)  # fmt: skip
                        except UntraceableLayout as e:  # skipped and said, not the end of the search
                            untraceable[(ep, etp)] = str(e)
                            break
                    layout = Layout(
                        world, ep, etp, sp, zero, recompute, offload, loss_chunk_mib=loss_chunk_mib
                    )
                    memory = rank_memory(cfg, layout, seq_length, micro_batch, gpu, counts, bf16, lora_rank,
                                         profiles[key])  # fmt: skip
                    traced += 1
                    if memory.fits:
                        fitting.append(memory)
                        break  # more recompute or offload at the same layout only costs
                    elif nearest is None or memory.total < nearest.total:
                        nearest = memory
        if progress is not None:
            progress(f"{world} GPUs: {traced} layouts traced, {len(fitting)} fit")
        if fitting:
            fitting.sort(key=lambda m: (variants.index((m.layout.recompute, m.layout.offload_activations)),
                                        m.layout.sp, m.layout.etp, m.total))  # fmt: skip
            return SearchResult(world, fitting[:show], not_planned=list(untraceable.values()))
    return SearchResult(0, [], nearest, list(untraceable.values()))


def what_would_fit(
    cfg: Glm53Config, memory: RankMemory, seq_length: int, micro_batch: int, bf16: bool = True, lora_rank: int = 0,
    indexer_loss_coef: float = 0.0,
) -> list[str]:  # fmt: skip
    """For a layout that does not fit: each single change that makes it fit (more recompute, ZeRO 2, SP, twice the
    GPUs at the same EP x ETP, half the row, activation offload under full recompute, the default loss chunk where
    the run materialises its logits or takes larger chunks), else each pair (full recompute with SP, with twice the
    GPUs, or with activation offload), as a line naming the trainer's flags and the total it gives. With the
    indexer loss, no change to full recompute (the trainer refuses it)."""
    layout = memory.layout
    full = dataclasses.replace(layout, recompute="full", zero=max(layout.zero, 1))
    singles: list[tuple[str, Layout, int]] = [
        (f"--recompute {mode}", dataclasses.replace(layout, recompute=mode), seq_length)
        for mode in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(layout.recompute) + 1 :]
    ]
    if layout.zero < 2:
        singles.append(
            ("ZeRO 2 (ds_configs/zero2_bf16.json)", dataclasses.replace(layout, zero=2), seq_length)
        )
    singles += [
        (f"--sp {sp}", dataclasses.replace(layout, sp=sp), seq_length)
        for sp in (2 * layout.sp, 4 * layout.sp)
    ]
    singles.append(
        (f"{2 * layout.world} GPUs", dataclasses.replace(layout, world=2 * layout.world), seq_length)
    )
    singles.append((f"--seq-length {seq_length // 2}", layout, seq_length // 2))
    # materialised logits or larger chunks than the default
    if layout.loss_chunk_mib == 0 or layout.loss_chunk_mib > LOSS_CHUNK_MIB:
        singles.append((f"--loss-chunk-mib {LOSS_CHUNK_MIB}",
                        dataclasses.replace(layout, loss_chunk_mib=LOSS_CHUNK_MIB), seq_length))  # fmt: skip
    if layout.recompute == "full" and not layout.offload_activations:
        singles.append(
            ("--offload-activations", dataclasses.replace(layout, offload_activations=True), seq_length)
        )
    pairs: list[tuple[str, Layout, int]] = [
        (f"--recompute full --sp {sp}", dataclasses.replace(full, sp=sp), seq_length)
        for sp in (2 * layout.sp, 4 * layout.sp, 8 * layout.sp)
    ]
    pairs.append((f"--recompute full and {2 * layout.world} GPUs", dataclasses.replace(full, world=2 * layout.world),
                  seq_length))  # fmt: skip
    if not layout.offload_activations:
        pairs.append(("--recompute full --offload-activations", dataclasses.replace(full, offload_activations=True),
                      seq_length))  # fmt: skip
    for tries in (singles, pairs):
        found = []
        for label, candidate, length in tries:
            if indexer_loss_coef > 0 and candidate.recompute == "full":
                continue  # the trainer refuses the indexer loss under full recompute
            try:
                validate_layout(
                    candidate.world, candidate.ep, candidate.etp, cfg, sp=candidate.sp, seq_length=length
                )
            except ValueError:
                continue
            total = rank_memory(
                cfg,
                candidate,
                length,
                micro_batch,
                memory.gpu,
                bf16=bf16,
                lora_rank=lora_rank,
                indexer_loss_coef=indexer_loss_coef,
            )
            if total.fits:
                found.append(f"{label}: {total.total / 2**30:.1f} GiB")
        if found:
            return found
    return []
