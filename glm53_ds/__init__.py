"""glm53_ds: GLM-5.3-Flash (transformers `glm5_next`) on megatron-core layer specs, trained with DeepSpeed."""

from .config import Glm53Config

__all__ = ["Glm53Config"]
__version__ = "0.1.0"
