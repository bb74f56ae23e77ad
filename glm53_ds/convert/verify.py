"""Compare a released HF checkpoint with a native one, tensor by tensor (max absolute difference table)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .export_hf import NativeCheckpoint
from .import_hf import HFSource


def verify(hf_dir: str, ckpt: str, out: Callable[..., object] = print) -> float:
    """Print one row per released tensor; returns the largest difference (inf for a missing tensor)."""
    native = NativeCheckpoint(ckpt)
    source = HFSource(hf_dir, fp8_dtype=torch.float32)
    available = source.released_names(native.cfg)
    worst = 0.0
    out(f"{'tensor':<80} {'shape':>20} {'max |diff|':>12}")
    for name, tensor in native.released():
        if name not in available:
            out(f"{name:<80} {'-':>20} {'missing':>12}")
            worst = float("inf")
            continue
        ref = source.read_released(name, available[name], native.cfg)
        if ref.shape != tensor.shape:
            out(f"{name:<80} {str(tuple(ref.shape)) + '!=' + str(tuple(tensor.shape)):>20} {'shape':>12}")
            worst = float("inf")
            continue
        diff = (ref.double() - tensor.double()).abs().max().item() if ref.numel() else 0.0
        worst = max(worst, diff)
        out(f"{name:<80} {str(tuple(ref.shape)):>20} {diff:>12.3g}")
    out(f"max difference: {worst:.3g}")
    return worst
