"""Checkpoint conversion between the released HF layout and the native training layout (both directions).

`hf_to_native(hf_dir, out, ep, etp, dtype)`, `native_to_hf(ckpt, out, hf_template)`, `verify(hf_dir, ckpt)`;
CLI: `python -m glm53_ds.convert {hf-to-native,native-to-hf,verify}` (console script `glm53-convert`).
"""

from __future__ import annotations

from typing import Any


def hf_to_native(*args: Any, **kwargs: Any) -> str:
    from .import_hf import hf_to_native as run

    return run(*args, **kwargs)


def native_to_hf(*args: Any, **kwargs: Any) -> str:
    from .export_hf import native_to_hf as run

    return run(*args, **kwargs)


def verify(*args: Any, **kwargs: Any) -> float:
    from .verify import verify as run

    return run(*args, **kwargs)
