"""Megatron tensor-parallel linears with GLM-5.3's conventions: no bias, config init, the output tensor only.

Attention runs with tensor parallel size 1 in this project (attention parameters are replicated); the linears
are megatron's so that layer specs compose with megatron code and its sharded checkpoints. Parameter names stay
`<name>.weight`, as in the released checkpoint.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig


class ColumnLinear(ColumnParallelLinear):
    def __init__(self, config: TransformerConfig, in_features: int, out_features: int) -> None:
        super().__init__(
            in_features, out_features, config=config, init_method=config.init_method,
            bias=False, gather_output=False, skip_bias_add=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class RowLinear(RowParallelLinear):
    def __init__(self, config: TransformerConfig, in_features: int, out_features: int) -> None:
        super().__init__(
            in_features, out_features, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]
