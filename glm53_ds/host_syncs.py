"""Count the operations that make the host wait for the device, and all aten ops, per layer.

On CUDA every device -> host read stalls the launch queue: the CPU stops queueing kernels until the GPU has
caught up. `torch.cuda.set_sync_debug_mode("warn")` finds them on a GPU; this counter finds the same sites on any
device (CPU included) from the ops themselves, so a test can hold a budget without a GPU.

Counted as host syncs (the op reads a device value on the host, or allocates by a device value):
  `_local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`, `if t.any():`), `nonzero` (incl. one-argument
  `torch.where`), `unique` (all forms), `masked_select`, boolean-mask indexing and index_put, `bincount` (reads
  the max), `repeat_interleave` without `output_size`, `.tolist()`, `torch.tensor` of host data with more than one
  element (`lift_fresh`; on CUDA a blocking copy from pageable memory), `equal` / `allclose`.
Every aten op is counted too: a proxy for kernel launches, the cost a grouped GEMM saves over a Python loop.

Attribution: forward ops go to the innermost registered scope (decoder layer i, MTP depth d, or `outside`) that is
running; backward ops go to `backward` (autograd runs them after every forward scope has closed). Each sync keeps
the first project frame (`file:line`) that issued it, so a failing budget says where.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that always read a device value on the host (by packet name: every overload counts)
_ALWAYS_SYNC = {
    "_local_scalar_dense",
    "nonzero",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "masked_select",
    "bincount",
    "equal",
    "allclose",
}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why this aten call synchronises with the host, or None."""
    name = func._overloadpacket.__name__
    if name in _ALWAYS_SYNC:
        return name
    if name in _INDEX_OPS and len(args) > 1 and any(_is_mask(i) for i in (args[1] or ())):
        return f"{name} with a boolean mask"
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
    if name == "lift_fresh" and args[0].numel() > 1:
        return "torch.tensor of host data"
    return None


@dataclass
class ScopeCounts:
    ops: int = 0
    syncs: int = 0
    sync_sites: Counter = field(default_factory=Counter)  # "reason @ file:line" -> count


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter(model) as c: ...` then `c.scopes`, `c.total_syncs`, `c.report()`.

    With a model, its decoder layers and MTP depths become scopes `layer{i}` / `mtp{d}` (forward hooks, removed on
    exit); ops outside them count to `outside`, backward ops to `backward`."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.scopes: dict[str, ScopeCounts] = {}
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._model = model
        self._tolist = torch.Tensor.tolist

    # ------------------------------------------------------------------ scopes
    def _scope_modules(self) -> Iterator[tuple[str, nn.Module]]:
        if self._model is None:
            return
        decoder = getattr(self._model, "decoder", None)
        for i, layer in enumerate(getattr(decoder, "layers", ()) or ()):
            yield f"layer{i}", layer
        for d, layer in enumerate(getattr(self._model, "mtp", None) or (), start=1):
            # the model calls an MTP depth's `predict`, which runs its transformer layer as a module
            yield f"mtp{d}", getattr(layer, "transformer_layer", layer)

    def _push(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        self._stack.pop()

    def _scope(self) -> ScopeCounts:
        name = self._stack[-1] if self._stack else ("backward" if _in_backward() else "outside")
        return self.scopes.setdefault(name, ScopeCounts())

    def _record_sync(self, reason: str) -> None:
        scope = self._scope()
        scope.syncs += 1
        scope.sync_sites[f"{reason} @ {_project_frame()}"] += 1

    # ------------------------------------------------------------------ context
    def __enter__(self) -> HostSyncCounter:
        for name, module in self._scope_modules():
            self._hooks.append(module.register_forward_pre_hook(self._push(name)))
            self._hooks.append(module.register_forward_hook(self._pop))
        counter = self

        def counted_tolist(t: torch.Tensor) -> Any:
            counter._record_sync("tolist")
            return counter._tolist(t)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        scope = self._scope()
        scope.ops += 1
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self._record_sync(reason)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ results
    @property
    def total_syncs(self) -> int:
        return sum(s.syncs for s in self.scopes.values())

    @property
    def total_ops(self) -> int:
        return sum(s.ops for s in self.scopes.values())

    def layer_scopes(self) -> dict[str, ScopeCounts]:
        return {k: v for k, v in self.scopes.items() if k.startswith(("layer", "mtp"))}

    def summary(self) -> dict[str, Any]:
        """JSON-able counts: per scope ops / syncs, totals, and the sync sites."""
        return {
            "total_ops": self.total_ops,
            "total_syncs": self.total_syncs,
            "scopes": {k: {"ops": v.ops, "syncs": v.syncs} for k, v in self.scopes.items()},
            "sync_sites": {k: dict(v.sync_sites) for k, v in self.scopes.items() if v.sync_sites},
        }

    def report(self) -> str:
        lines = [f"{self.total_syncs} host syncs, {self.total_ops} aten ops"]
        for name, s in self.scopes.items():
            lines.append(f"  {name}: {s.ops} ops, {s.syncs} syncs")
            lines += [f"    {n} x {site}" for site, n in s.sync_sites.most_common()]
        return "\n".join(lines)


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _project_frame() -> str:
    """The innermost stack frame in glm53_ds (else the innermost outside torch), as `path:line`; a read through
    `host_reads` is its caller's."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "/glm53_ds/" in f.filename and not f.filename.endswith(("host_syncs.py", "host_reads.py")):
            return f"{f.filename.split('/glm53_ds/')[-1]}:{f.lineno}"
    for f in reversed(frames):
        if "/torch/" not in f.filename:
            return f"{f.filename}:{f.lineno}"
    return "?"
