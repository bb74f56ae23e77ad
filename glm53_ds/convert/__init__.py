"""Checkpoint conversion between the released HF layout and the native training layout (both directions).

`hf_to_native(hf_dir, out, ep, etp, dtype)`, `native_to_hf(ckpt, out, hf_template)`, `verify(hf_dir, ckpt)`;
CLI: `python -m glm53_ds.convert {hf-to-native,native-to-hf,verify}` (console script `glm53-convert`).
"""

from .export_hf import load_native, native_to_hf
from .import_hf import hf_to_native
from .verify import verify

__all__ = ["hf_to_native", "load_native", "native_to_hf", "verify"]
