"""The distributed layer the model may use; it never imports DeepSpeed.

- `layout.py`: `ParallelLayout` / `init_layout` (EP x ETP process groups, megatron `pg_collection`);
- `state.py`: `ensure_model_parallel` (world 1 when nothing is set up), `free_port`, `default_backend`;
- `expert_shard.py`: `ExpertShard`, the one rule of which rank holds which expert rows;
- `comm.py`, `moe_dispatch.py`: differentiable collectives and the dropless EP x ETP token dispatch;
- `params.py`, `grad_norm.py`, `replicas.py`: parameter kinds, the global gradient norm, replica checks.
"""

from .expert_shard import ExpertShard
from .layout import ParallelLayout, init_layout, validate_layout
from .state import ensure_model_parallel

__all__ = ["ExpertShard", "ParallelLayout", "ensure_model_parallel", "init_layout", "validate_layout"]
