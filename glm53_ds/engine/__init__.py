"""The DeepSpeed engine of glm53_ds: the only package that imports DeepSpeed.

- `handle.py`: `Glm53Engine`, what `build_engine` returns: the DeepSpeed engine (`.ds`), the layout, the fp32-kept
  parameters and the gradient-sync state, typed, with the methods the trainer and the checkpoints use;
- `build.py`: `build_engine(model, ds_config, optimizer=None, layout=None)` (also `glm53_ds.build_engine`),
  `init_distributed` / `close_distributed`, `prepare_model`, `optimizer_param_groups`;
- `deepspeed_internals.py`: every private DeepSpeed symbol glm53_ds touches (`PATCHED_SYMBOLS`), the version check,
  the gradient-sync patch;
- `mpu.py`: `DeepSpeedMpu`; `fp32_params.py`: HF's fp32-kept parameters outside DeepSpeed's bf16 cast, with their
  own reduction, norm share and fp32 optimizer;
- `checkpoint.py`: a running engine's checkpoints (`save_checkpoint` / `load_checkpoint`: DeepSpeed's partitions and
  the layout-free optimizer state over the format `glm53_ds/checkpoint/` owns), `export_engine_to_hf` and `export_engine_to_peft`.
"""

import os

import torch

if "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available():
    # DeepSpeed's own choice on a machine without an accelerator, named before it imports: otherwise every rank
    # warns "Setting accelerator to CPU" on every run (DS_ACCELERATOR is DeepSpeed's documented override)
    os.environ["DS_ACCELERATOR"] = "cpu"

from .build import (  # noqa: E402  (after the accelerator is named)
    build_engine,
    close_distributed,
    describe_param_groups,
    init_distributed,
    optimizer_param_groups,
    prepare_model,
)
from .checkpoint import (
    CheckpointError,
    check_checkpoint_fits,
    export_engine_to_hf,
    export_engine_to_peft,
    layout_record,
    load_checkpoint,
    read_client_state,
    save_checkpoint,
    verify_checkpoint,
)
from .deepspeed_internals import NonFiniteGradientError
from .handle import Glm53Engine

__all__ = [
    "build_engine",
    "check_checkpoint_fits",
    "CheckpointError",
    "close_distributed",
    "describe_param_groups",
    "export_engine_to_hf",
    "export_engine_to_peft",
    "Glm53Engine",
    "init_distributed",
    "layout_record",
    "load_checkpoint",
    "NonFiniteGradientError",
    "optimizer_param_groups",
    "prepare_model",
    "read_client_state",
    "save_checkpoint",
    "verify_checkpoint",
]
