"""The DeepSpeed engine of glm53_ds: the only package that imports DeepSpeed.

- `build.py`: `build_engine(model, ds_config, optimizer=None, layout=None)` (also `glm53_ds.build_engine`),
  `init_distributed` / `close_distributed`, `prepare_model`, `optimizer_param_groups`;
- `deepspeed_internals.py`: every private DeepSpeed symbol glm53_ds touches (`PATCHED_SYMBOLS`), the version check,
  the gradient-sync patch;
- `mpu.py`: `DeepSpeedMpu`; `fp32_params.py`: HF's fp32-kept parameters outside DeepSpeed's bf16 cast, with their
  own reduction, norm share and fp32 optimizer;
- `checkpoint.py`: training checkpoints (`save_checkpoint` / `load_checkpoint`) and `export_engine_to_hf`.
"""

from .build import build_engine, close_distributed, init_distributed, optimizer_param_groups, prepare_model
from .checkpoint import export_engine_to_hf, load_checkpoint, save_checkpoint
from .deepspeed_internals import NonFiniteGradientError

__all__ = [
    "build_engine",
    "close_distributed",
    "export_engine_to_hf",
    "init_distributed",
    "NonFiniteGradientError",
    "load_checkpoint",
    "optimizer_param_groups",
    "prepare_model",
    "save_checkpoint",
]
