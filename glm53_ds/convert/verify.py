"""Compare a released HF checkpoint with a native one, tensor by tensor (max absolute difference table).

Both tensor sets are compared whole: a released tensor the native checkpoint lacks (its MTP layer stripped, say)
and a text tensor only the HF directory has are reported as rows and fail the check, as a difference does.
Vision tensors (not part of the text model) are not compared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .export_hf import NativeCheckpoint
from .import_hf import HFSource
from .names import released_layout


def verify(hf_dir: str, ckpt: str, out: Callable[..., object] = print, every_tensor: bool = False) -> float:
    """Print a row per differing, missing or extra tensor (`every_tensor`: every tensor, ~37,000 rows at the
    released size) and a verdict line (`verify: OK (...)` when every tensor is equal, else `verify: FAILED (N
    tensors differ, max ...)`); returns the largest difference (inf for a missing or extra tensor)."""
    native = NativeCheckpoint(ckpt)
    source = HFSource(hf_dir, fp8_dtype=torch.float32)
    cfg = native.model_config
    available = source.released_names(cfg)
    layout = released_layout(cfg, mtp=native.mtp)
    worst, differ = 0.0, 0
    header = [f"{'tensor':<80} {'shape':>20} {'max |diff|':>12}"]

    def row(line: str, shown: bool = True) -> None:
        if shown or every_tensor:
            for text in header:  # once, before the first row
                out(text)
            header.clear()
            out(line)

    for name, placements in layout.items():
        if name not in available:
            row(f"{name:<80} {'-':>20} {'not in HF':>12}")
            worst, differ = float("inf"), differ + 1
            continue
        try:
            pieces = [native.read_released(p) for p in placements]
        except (KeyError, FileNotFoundError):
            row(f"{name:<80} {'-':>20} {'not native':>12}")
            worst, differ = float("inf"), differ + 1
            continue
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        ref = source.read_released(name, available[name], cfg)
        if ref.shape != tensor.shape:
            row(f"{name:<80} {str(tuple(ref.shape)) + '!=' + str(tuple(tensor.shape)):>20} {'shape':>12}")
            worst, differ = float("inf"), differ + 1
            continue
        diff = (ref.double() - tensor.double()).abs().max().item() if ref.numel() else 0.0
        worst, differ = max(worst, diff), differ + (diff != 0.0)
        row(f"{name:<80} {str(tuple(ref.shape)):>20} {diff:>12.3g}", shown=diff != 0.0)
    for name in sorted(set(available) - set(layout)):
        row(f"{name:<80} {'-':>20} {'only in HF':>12}")
        worst, differ = float("inf"), differ + 1
    out(f"max difference: {worst:.3g}")
    if differ:
        out(f"verify: FAILED ({differ} tensor{'s' if differ != 1 else ''} differ, max |diff| {worst:.3g})")
    else:
        out(f"verify: OK ({len(layout)} tensors equal)")
    return worst
