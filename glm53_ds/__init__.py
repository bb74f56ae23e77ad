"""glm53_ds: GLM-5.3-Flash (transformers `glm5_next`) on megatron-core layer specs, trained with DeepSpeed.

Entry points: `Glm53Config`, `make_transformer_config(cfg, dtype, mtp=False)`, `build_model(config, dtype)`,
`load_hf(hf_dir, dtype)`, `load_hf_into(model, hf_dir)` (a `Glm53Model` or a stock megatron `GPTModel`),
`get_glm53_block_spec(cfg)` / `get_glm53_mtp_block_spec(cfg)` (megatron specs),
`build_engine(model, ds_config, optimizer=None, layout=None)`.

The model half (config, mhc, layers, model, specs) never imports DeepSpeed: `build_engine` is resolved on first
use (module `__getattr__`), so `import glm53_ds` and every model module stay DeepSpeed-free.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

# megatron-core announces on import that Transformer Engine / Apex are not installed (five notices); glm53_ds picks
# its kernels itself (backends.py) and uses neither, so while it imports megatron those notices are left out
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning
    )
    from .config import Glm53Config
    from .hf_loader import load_hf, load_hf_into
    from .model import Glm53Model, build_model
    from .specs import get_glm53_block_spec, get_glm53_mtp_block_spec
    from .transformer_config import make_transformer_config

if TYPE_CHECKING:
    from .engine import build_engine

__all__ = [
    "Glm53Config",
    "Glm53Model",
    "build_engine",
    "build_model",
    "get_glm53_block_spec",
    "get_glm53_mtp_block_spec",
    "load_hf",
    "load_hf_into",
    "make_transformer_config",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "build_engine":  # the DeepSpeed half, imported only when asked for
        from .engine import build_engine

        return build_engine
    raise AttributeError(f"module 'glm53_ds' has no attribute {name!r}")
