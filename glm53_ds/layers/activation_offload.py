"""Activation offload: what full recompute keeps of each layer goes to host memory as it is produced, and comes back
one layer ahead of the backward (`--offload-activations`, `Glm53TransformerConfig.offload_activations`).

Under full recompute (megatron's reentrant checkpoint, one layer per checkpoint) a layer keeps only its inputs:
the packed mHC streams [s*n, b, D] (1 GiB per layer at 32k tokens, released width), kept on the device across the
whole forward and backward. `ActivationOffload` is a saved-tensors hook pair active around the decoder's forward:

- pack: a saved tensor of at least `min_bytes` (not a parameter) is copied into a pinned host buffer (a pool reused
  across steps) on a side stream, asynchronously on CUDA; the device tensor is released once its copy is done.
- unpack (backward, last layer first): the tensor comes back to its device, and the copy of the entry saved before
  it (the next layer the backward reaches) starts on the side stream, so each layer's inputs are on the device
  when its recompute starts, and at most two layers' are there at a time.

The values are copied exactly, so losses and gradients are bitwise those of a run without offload. On CPU the host
copy is a plain copy (there is no device memory to save there; it keeps the path tested). The recomputed layer's
own saved tensors (created in backward) stay on the device: that is the layer's working set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors (masks, router outputs) stay where they are


def _pool_key(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
    """Host buffers are reused for tensors of the same shape and dtype (pinned when they come from CUDA)."""
    return tuple(shape), dtype, device.type == "cuda"


@dataclass
class _Entry:
    host: torch.Tensor | None  # None on meta tensors (a shape-only run: the host copy is a shape, not memory)
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    pending: torch.Tensor | None = None  # the device tensor until its copy to the host is done (CUDA)
    copied: Any = None  # the CUDA event of that copy
    back: torch.Tensor | None = None  # prefetched onto the device (CUDA: `arrived` marks its copy)
    arrived: Any = None


@dataclass
class ActivationOffload:
    """Saved-tensors hooks that keep large saved tensors in host memory between forward and backward."""

    min_bytes: int = MIN_OFFLOAD_BYTES
    entries: list[_Entry | None] = field(default_factory=list)
    offloaded_bytes: int = 0  # this step's, for the log and the tests
    _pool: dict[tuple[Any, ...], list[torch.Tensor]] = field(default_factory=dict)
    _returning: list[_Entry] = field(default_factory=list)  # released in backward; pooled at the next forward
    _stream: Any = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run a forward in; each forward starts a new set of entries."""
        # the buffers released in the last backward: pooled once the copies that read them are done
        for entry in self._returning:
            for copy in (entry.copied, entry.arrived):
                if copy is not None:
                    copy.synchronize()
            assert entry.host is not None
            self._pool.setdefault(_pool_key(entry.shape, entry.dtype, entry.device), []).append(entry.host)
        self.entries, self.offloaded_bytes, self._returning = [], 0, []
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ------------------------------------------------------------------ forward
    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < self.min_bytes or t.is_sparse:
            return t
        self._reap()
        host = None if t.is_meta else self._buffer(t)
        entry = _Entry(host, t.shape, t.dtype, t.device)
        if host is not None and t.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                entry.copied = torch.cuda.Event()
                entry.copied.record(stream)
            entry.pending = t  # freed once the copy is done (`_reap`), not before
        elif host is not None:
            host.copy_(t)
        self.entries.append(entry)
        self.offloaded_bytes += t.numel() * t.element_size()
        return len(self.entries) - 1

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        free = self._pool.get(_pool_key(t.shape, t.dtype, t.device))
        if free:
            return free.pop()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)

    def _reap(self) -> None:
        for entry in self.entries:
            if entry is not None and entry.pending is not None and entry.copied.query():
                entry.pending = None

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    # ------------------------------------------------------------------ backward
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        index: int = packed
        entry = self.entries[index]
        assert entry is not None, "an offloaded activation was read twice (a retained graph is not supported)"
        out = self._fetch(entry)
        self._release(index)
        if index > 0:  # the next layer the backward reaches: on its way while this one recomputes
            self._prefetch(index - 1)
        return out

    def _fetch(self, entry: _Entry) -> torch.Tensor:
        if entry.pending is not None:  # still on the device (its copy may not even be done): use it
            return entry.pending
        if entry.back is not None:
            if entry.arrived is not None:
                torch.cuda.current_stream(entry.device).wait_event(entry.arrived)
            return entry.back
        return self._to_device(entry)

    @staticmethod
    def _to_device(entry: _Entry) -> torch.Tensor:
        if entry.host is None:
            return torch.empty(entry.shape, dtype=entry.dtype, device=entry.device)
        return entry.host.to(entry.device, copy=True)

    def _prefetch(self, index: int) -> None:
        entry = self.entries[index]
        if entry is None or entry.pending is not None or entry.back is not None:
            return
        if entry.device.type != "cuda" or entry.host is None:
            entry.back = self._to_device(entry)
            return
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            entry.back = entry.host.to(entry.device, non_blocking=True)
            entry.arrived = torch.cuda.Event()
            entry.arrived.record(stream)
        entry.back.record_stream(torch.cuda.current_stream(entry.device))

    def _release(self, index: int) -> None:
        entry = self.entries[index]
        assert entry is not None
        self.entries[index] = None
        entry.pending = entry.back = None
        if entry.host is not None:  # no host wait here: its buffer returns to the pool at the next forward
            self._returning.append(entry)
