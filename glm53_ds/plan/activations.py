"""Activation memory of one rank: measured per layer kind on a reduced model, composed over the whole model.

A training step's activation memory is what the forward keeps for backward (saved tensors, layer outputs) plus what
each backward step allocates on top while it runs. Both depend on the code as much as on the widths (which
projections keep their inputs, what a fused kernel saves, what recompute drops), so the constants are measured, not
derived:

1. `reduced_config`: the first decoder layer and the first layer of every other kind (layer type, MLP type,
   indexer type), the MTP layer: the model's whole variety in a few layers, at the real widths.
2. `profile_step` runs one training step of that model (forward, loss, backward) under `LiveBytes`, which counts the
   bytes of every tensor storage created in the step while it is alive (parameter gradients apart: the planner's
   state counts them), and marks each unit's boundaries with module hooks. Per unit (decoder layer or MTP layer)
   it measures `saved` (live bytes after its forward minus before), `forward_peak` and `backward_peak` (the peak
   while it runs, above the live bytes before its forward). The parts around the units are measured too: the
   embedding (`before`), what lies between the last decoder layer and the MTP layer (`gap`) and the loss head
   (`head_saved`, `head_forward_peak`, `head_backward_peak`).
3. `ActivationProfile.peak(kinds)` composes the whole model's peak from the unit kinds in their order: in forward,
   unit l runs above `before + sum of saved below it`; in backward, unit l runs when the units above it have freed
   theirs, so its peak is `before + saved below l + backward_peak(l)`; the loss head's backward runs above
   everything saved. The step's peak is the largest of these.

On meta tensors (`plan/__main__.py` at the released size) the fused kernels keep what their contracts say (their
ops' fake implementations and registered autograd, layers/fused_kernels.py; their backward's transient buffers are
added at the backward op's call) and the experts get balanced routing; on CPU the same code measures the torch path, which
the test suite uses to check the composition against the measured peaks of whole models (tests/plan).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import Glm53Config
from ..layers.fused_kernels import workspace_of_backward
from ..layers.mtp import Glm53MtpLayer
from ..model import Glm53Model
from ..parallel.layout import smallest_world, validate_layout
from .dry_run import rank_model_on_meta
from .run import PlannedRun

MTP_KIND = "mtp"


def _pinned(storage: torch.UntypedStorage) -> bool:
    """A pinned host buffer (the activation offload's): host memory, not the device's."""
    return storage.device.type == "cpu" and torch.cuda.is_available() and storage.is_pinned()


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated under this mode that are alive now (`live`), and the peak since the
    last `mark` (`peak`). An operation's output is an allocation when its storage is none of its inputs' (views,
    in-place and aliasing operations allocate nothing), so parameters, buffers and inputs made before are never
    counted; a storage that becomes a parameter's gradient leaves the count when it is accumulated (`exclude`);
    pinned host buffers (the activation offload's, on CUDA) are host memory and not counted. Under a dispatch mode
    autograd sums a parameter's several gradients out of place (its in-place sum refuses subclass-like tensors), so a
    parameter used twice would count one gradient more than a GPU holds; the model gives each of its vocabulary
    matrices one use (one embedding lookup, one loss-head call), and tests/layers/test_chunked_ce.py holds it to it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.highest = 0  # the peak over the mode's whole life (never reset)
        self._sizes: dict[int, int] = {}  # storage (its StorageImpl's address) -> bytes counted

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if (
                    storage._cdata not in inputs
                    and storage._cdata not in self._sizes
                    and not _pinned(storage)
                ):
                    self._count(storage)
        # a fused kernel's backward also holds its transient buffers while its gradients exist (fused_kernels.py)
        transient = sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in workspace_of_backward(func, args)
        )
        if transient:
            self.peak = max(self.peak, self.live + transient)
            self.highest = max(self.highest, self.live + transient)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        self.highest = max(self.highest, self.live)
        weakref.finalize(storage, self._free, key)  # storages keep their Python object while they live

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def exclude(self, t: torch.Tensor) -> None:
        """`t`'s storage is no longer counted (a parameter's gradient: training state, not activations)."""
        self.live -= self._sizes.pop(t.untyped_storage()._cdata, 0)

    def mark(self) -> int:
        """Start a new peak window at the live bytes now; returns them."""
        self.peak = self.live
        return self.live


@dataclass
class UnitBytes:
    """One decoder (or MTP) layer's activation bytes: kept after its forward, and its peaks above what lay below."""

    saved: int = 0
    forward_peak: int = 0
    backward_peak: int = 0
    host: int = 0  # kept in host memory instead (--offload-activations: the layer's inputs)


@dataclass
class ActivationProfile:
    """Measured activation bytes of one micro-batch at one layout and length (see the module docstring)."""

    units: dict[str, UnitBytes] = field(default_factory=dict)  # kind -> bytes
    before: int = 0  # embedding output (and the inputs it derives) before the first decoder layer
    # kept between the last decoder layer and the MTP layer (stream mean, MTP embedding and norms)
    gap: int = 0
    head_saved: int = 0  # kept by the loss head (final norm, chunked cross-entropy, the MTP head)
    head_forward_peak: int = 0  # peak of the loss head's forward above what was kept before it
    # peak of the loss head's backward above everything kept at the end of forward
    head_backward_peak: int = 0
    mtp_layers: int = 0  # MTP depths after the decoder (each a unit of kind MTP_KIND)
    measured_peak: int = 0  # the profiled step's own peak (of the model it ran: the reduced one for a plan)

    def peak(self, kinds: list[str]) -> int:
        """The step's peak activation bytes for decoder units of `kinds` in order (then the MTP layers)."""
        order = list(kinds) + [MTP_KIND] * self.mtp_layers
        missing = sorted(set(order) - set(self.units))
        if missing:
            raise ValueError(f"no measured profile for layer kinds {missing}; profiled: {sorted(self.units)}")
        peaks, below = [], self.before
        for i, kind in enumerate(order):
            if i == len(kinds):  # the first MTP layer
                below += self.gap
            unit = self.units[kind]
            peaks.append(below + unit.forward_peak)
            peaks.append(below + unit.backward_peak)
            below += unit.saved
        peaks.append(below + self.head_forward_peak)
        peaks.append(below + self.head_saved + self.head_backward_peak)
        return max(peaks)

    def host_saved(self, kinds: list[str]) -> int:
        """Bytes the activation offload keeps in host memory at the end of the forward (decoder units only)."""
        return sum(self.units[k].host for k in kinds)

    def saved(self, kinds: list[str]) -> int:
        """Bytes kept at the end of the forward (everything backward will read)."""
        order = list(kinds) + [MTP_KIND] * self.mtp_layers
        return self.before + self.gap + self.head_saved + sum(self.units[k].saved for k in order)


def layer_kind(cfg: Glm53Config, i: int) -> str:
    """Decoder layer `i`'s kind: what decides its activations (attention type, MLP type, indexer type)."""
    kind = f"{cfg.layer_types[i]}/{cfg.mlp_layer_types[i]}"
    return kind + (f"/{cfg.indexer_types[i]}-indexer" if cfg.layer_types[i] == "indexed_attention" else "")


def layer_kinds(cfg: Glm53Config) -> list[str]:
    return [layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)]


def reduced_config(cfg: Glm53Config) -> Glm53Config:
    """`cfg` with only the first decoder layer of each kind (in order; the MTP layer kept)."""
    firsts: dict[str, int] = {}
    for i, kind in enumerate(layer_kinds(cfg)):
        firsts.setdefault(kind, i)
    keep = sorted(firsts.values())
    return dataclasses.replace(
        cfg,
        num_hidden_layers=len(keep),
        layer_types=[cfg.layer_types[i] for i in keep],
        mlp_layer_types=[cfg.mlp_layer_types[i] for i in keep],
        indexer_types=[cfg.indexer_types[i] for i in keep],
    )


def _units(model: Glm53Model) -> list[tuple[str, nn.Module]]:
    """(kind, module) of every decoder layer, then every MTP layer's transformer layer (kind MTP_KIND)."""
    cfg = model.glm
    units = [(layer_kind(cfg, i), layer) for i, layer in enumerate(model.decoder.layers)]
    for mtp in model.mtp or []:
        assert isinstance(mtp, Glm53MtpLayer)
        units.append((MTP_KIND, mtp.transformer_layer))
    return units


@contextmanager
def _unit_hooks(
    model: Glm53Model, tracker: LiveBytes, record: dict[int, dict[str, int]]
) -> Iterator[list[bool]]:  # fmt: skip
    """Marks each unit's forward and backward with the tracker; yields a flag list whose item is True in backward."""
    in_backward = [False]
    handles: list[Any] = []
    offload = model.activation_offload

    def offloaded() -> int:
        return offload.offloaded_bytes if offload is not None else 0

    running: list[int] = []  # the unit whose backward window is open (none: the loss head's)

    def close_window() -> None:
        if running:
            record[running.pop()]["backward_window"] = tracker.peak
        else:
            record.setdefault(-1, {})["head_backward_window"] = tracker.peak

    def begin_backward(index: int) -> None:
        close_window()
        tracker.mark()
        running.append(index)

    for index, (_, module) in enumerate(_units(model)):

        def pre(_module: nn.Module, _args: Any, index: int = index) -> None:
            if in_backward[0]:  # full recompute: the layer's backward starts with its forward again
                if running != [index]:
                    begin_backward(index)
                return
            if index > 0:  # the previous layer's input went to the host once its checkpoint returned
                record[index - 1].setdefault("host_after", offloaded())
            record[index] = {"before": tracker.mark(), "host_before": offloaded()}

        def post(_module: nn.Module, _args: Any, out: Any, index: int = index) -> None:
            if in_backward[0]:
                return
            rec = record[index]
            rec["forward_window"], rec["after"] = tracker.peak, tracker.live
            hidden = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(lambda grad, index=index: begin_backward(index))
            tracker.mark()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield in_backward
    finally:
        close_window()
        for h in handles:
            h.remove()


def profile_step(model: Glm53Model, step: Callable[[], torch.Tensor]) -> ActivationProfile:
    """Run `step()` (a forward returning the loss) and its backward under `LiveBytes`; measure `model`'s units.
    Parameter gradients are left out of the count as they are accumulated (they are training state)."""
    tracker = LiveBytes()
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: tracker.exclude(p.grad))
        for p in model.parameters()
        if p.requires_grad
    ]
    record: dict[int, dict[str, int]] = {}
    units = _units(model)
    try:
        with tracker, _unit_hooks(model, tracker, record) as in_backward:
            tracker.mark()
            loss = step()
            end_of_forward = tracker.live
            offload = model.activation_offload
            for (
                rec
            ) in record.values():  # the last layer's input: offloaded by the end of the decoder's forward
                rec.setdefault("host_after", offload.offloaded_bytes if offload is not None else 0)
            head_forward_window = tracker.peak
            in_backward[0] = True
            tracker.mark()
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    mtp_layers = sum(kind == MTP_KIND for kind, _ in units)
    profile = ActivationProfile(mtp_layers=mtp_layers, measured_peak=tracker.highest)
    first, last_decoder = record[0], max(i for i, (k, _) in enumerate(units) if k != MTP_KIND)
    profile.before = first["before"]
    for index, (kind, _) in enumerate(units):
        rec = record[index]
        host = rec["host_after"] - rec["host_before"]  # this layer's inputs, kept on the host, not the device
        unit = UnitBytes(
            saved=rec["after"] - rec["before"] - host,
            forward_peak=rec["forward_window"] - rec["before"],
            backward_peak=rec.get("backward_window", rec["after"]) - rec["before"],
            host=host,
        )
        if kind not in profile.units:
            profile.units[kind] = unit
        else:  # a kind seen before (a whole model, not a reduced one): keep the largest
            profile.units[kind] = UnitBytes(*map(max, dataclasses.astuple(profile.units[kind]),
                                                 dataclasses.astuple(unit)))  # fmt: skip

    def kept_after(index: int) -> int:
        """Live bytes once unit `index` is done and its inputs are on the host (offload)."""
        rec = record[index]
        return rec["after"] - (rec["host_after"] - rec["host_before"])

    tail = kept_after(len(units) - 1)
    mtp_index = next((i for i, (k, _) in enumerate(units) if k == MTP_KIND), None)
    if mtp_index is not None:
        profile.gap = record[mtp_index]["before"] - kept_after(last_decoder)
    profile.head_saved = end_of_forward - tail
    profile.head_forward_peak = max(head_forward_window, end_of_forward) - tail
    profile.head_backward_peak = (
        record.get(-1, {}).get("head_backward_window", end_of_forward) - end_of_forward
    )
    return profile


def plan_activations(run: PlannedRun) -> ActivationProfile:
    """One rank's activation profile at the run's layout (rank 0 of the smallest fake world of the layout: every
    rank of a layout holds the same shapes), measured on the meta device on the reduced model: one micro-batch of
    the run's micro batch x length through the loss and back, with its recompute mode, offload, tiles, loss chunk,
    losses and adapters (`rank_model_on_meta`). Compose it over the whole model with `peak(layer_kinds(cfg))`."""
    c = run.config
    validate_layout(
        smallest_world(c.ep, c.etp, c.sp), c.ep, c.etp, run.model, sp=c.sp, seq_length=c.seq_length
    )
    model, _ = rank_model_on_meta(run.variant(model=reduced_config(run.model)))
    assert isinstance(model, Glm53Model)
    ids = torch.zeros(c.micro_batch_size, c.seq_length, dtype=torch.long, device="meta")
    return profile_step(model, lambda: model(ids, labels=ids))
