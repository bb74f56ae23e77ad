"""Megatron tensor-parallel linears with GLM-5.3's conventions: no bias, config init, the output tensor only.

Attention runs with tensor parallel size 1 in this project (attention parameters are replicated); the linears
are megatron's so that layer specs compose with megatron code and its sharded checkpoints. Parameter names stay
`<name>.weight`, as in the released checkpoint.

`RowParallelLinearWithGroup` is megatron's row linear handing its matmul its own TP group: megatron-core 0.16's
`RowParallelLinear.forward` hands it `tp_group=None`, so the matmul looks the group up again at every call, with a
DeprecationWarning on global rank 0 that torch.compile cannot trace (a graph break on rank 0 only, so ranks would
compile different graphs). Every row linear of the model is one.
"""

from __future__ import annotations

from typing import Any

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


class RowParallelLinearWithGroup(RowParallelLinear):
    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, tp_group: Any = None,
                      **kwargs: Any) -> torch.Tensor:  # fmt: skip
        return super()._forward_impl(
            input, weight, *args, tp_group=self.tp_group if tp_group is None else tp_group, **kwargs
        )


class RowLinear(RowParallelLinearWithGroup):
    def __init__(self, config: TransformerConfig, in_features: int, out_features: int) -> None:
        super().__init__(
            in_features, out_features, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]
