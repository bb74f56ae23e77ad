"""What differs between the megatron-core releases glm53_ds runs with, in one place: 0.16.1 (Python 3.11, CI) and
0.19.2 (Python 3.12, `tools/megatron_compat.sh 0.19.2`). Other modules ask here; none compares versions
(tests/compat/test_megatron.py keeps it so). Each difference is found by what megatron has, not by its version
number, so a release between the two answers for itself.

| what | 0.16.1 | 0.19.2 | here |
|---|---|---|---|
| the whole-layer CUDA-graph scope, without megatron's deprecation warning on every config | `cuda_graph_scope=[]` ("full" warns) | `cuda_graph_modules=[]` (`cuda_graph_scope` itself warns) | `cuda_graph_whole_layer()` |
| `GPTModel(mtp_block_spec=...)` with a config lacking `mtp_num_layers` | builds the MTP block; the GLM MTP layer fills the fields | decides before building (`mtp_on_this_rank`): no MTP block, silently | `GPT_MODEL_NEEDS_MTP_FIELDS`: pass `make_transformer_config(cfg, mtp=True)` (docs/usage.md) |
| what megatron's MTP block passes each MTP layer | `config`, `layer_number`, `vp_stage`, `pg_collection` | also `mtp_layer_pattern`, `name` | `Glm53MtpLayer` takes and ignores them (one structure) |
| what an MTP layer returns to megatron's MTP block | `(hidden, input_ids, position_ids)` | also the padding mask, which the block hands the next depth | `MTP_LAYER_RETURNS_PADDING_MASK` (the GLM layer returns the mask it was given: it shifts by its own depth) |
| `GPTModel` | megatron's decoder model | deprecated for `HybridModel` (critical fixes only); runs unchanged | docs/architecture.md |
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core import __version__ as MEGATRON_VERSION
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer.transformer_config import TransformerConfig

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}

# megatron >= 0.17 decides whether a GPTModel has an MTP block from config.mtp_num_layers before building it
GPT_MODEL_NEEDS_MTP_FIELDS: bool = hasattr(gpt_model, "mtp_on_this_rank")


def _mtp_layer_returns_padding_mask() -> bool:
    """Whether megatron's own MTP layer hands the padding mask back to its block (its forward's last return)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    source = inspect.getsource(MultiTokenPredictionLayer.forward)
    returns = [line.strip() for line in source.splitlines() if line.strip().startswith("return ")]
    return bool(returns) and returns[-1].replace(" ", "").endswith(",padding_mask")


MTP_LAYER_RETURNS_PADDING_MASK: bool = _mtp_layer_returns_padding_mask()


def cuda_graph_whole_layer() -> dict[str, Any]:
    """TransformerConfig fields for megatron's default whole-layer CUDA-graph scope, spelled the way this
    megatron-core takes without a deprecation warning."""
    if "cuda_graph_modules" in _CONFIG_FIELDS:
        return {"cuda_graph_modules": []}
    return {"cuda_graph_scope": []}


__all__ = [
    "GPT_MODEL_NEEDS_MTP_FIELDS",
    "MEGATRON_VERSION",
    "MTP_LAYER_RETURNS_PADDING_MASK",
    "cuda_graph_whole_layer",
]
