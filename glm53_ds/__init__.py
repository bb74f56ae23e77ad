"""glm53_ds: GLM-5.3-Flash (transformers `glm5_next`) on megatron-core layer specs, trained with DeepSpeed.

Entry points: `Glm53Config`, `build_model(config, dtype)`, `load_hf(hf_dir, dtype)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import Glm53Config

if TYPE_CHECKING:
    from .model import Glm53Model

__all__ = ["Glm53Config", "build_model", "load_hf"]
__version__ = "0.1.0"


def build_model(config: Any, dtype: Any = None, **kwargs: Any) -> Glm53Model:
    import torch

    from .model import build_model as _build

    return _build(config, dtype=dtype or torch.float32, **kwargs)


def load_hf(hf_dir: str, dtype: Any = None, **kwargs: Any) -> Glm53Model:
    import torch

    from .hf_loader import load_hf as _load

    return _load(hf_dir, dtype=dtype or torch.float32, **kwargs)
