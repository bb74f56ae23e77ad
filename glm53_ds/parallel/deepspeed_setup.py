"""Preparing a Glm53Model for `deepspeed.initialize`.

- Expert parameters are tagged as DeepSpeed expects (`allreduce = False`, `group_name = "ep_size_<EP>"`), and,
  under ETP, `tensor_model_parallel = True` so DeepSpeed's gradient norm counts each expert slice on its
  shard (replicated parameters are counted once).
- DeepSpeed handles expert gradients only when it finds a `deepspeed.moe.layer.MoE` module; a parameter-less
  marker of that type is attached to each GLM MoE layer (it holds no state and never runs).
- megatron's `tensor_model_parallel` flag on attention/dense weights is cleared (TP = 1: they are replicas).
- `optimizer_param_groups` splits parameters into DeepSpeed's MoE optimizer groups (ZeRO requires it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .initialize import ParallelLayout


def _deepspeed_moe_marker(num_experts: int, ep_size: int, group_name: str) -> nn.Module:
    from deepspeed.moe.layer import MoE

    class DeepSpeedMoEMarker(MoE):
        """Tells the DeepSpeed engine that the model has MoE layers; holds nothing and never runs.

        Its process groups are the ones `initialize` registered; DeepSpeed must not create its own."""

        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = group_name

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            pass

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the DeepSpeed MoE marker is not a layer")

    return DeepSpeedMoEMarker()


def prepare_model_for_deepspeed(model: nn.Module, layout: ParallelLayout) -> None:
    from ..layers.moe import Glm53MoE

    # megatron marks its linear weights tensor_model_parallel=True even at TP=1; attention runs with TP=1
    # here, so those weights are replicated and must be reduced and counted in norms as such.
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.tensor_model_parallel = False  # type: ignore[attr-defined]
    for module in model.modules():
        if not isinstance(module, Glm53MoE):
            continue
        for p in module.experts.parameters():
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = layout.expert_group_name  # type: ignore[attr-defined]
            if layout.etp > 1:
                p.tensor_model_parallel = True  # type: ignore[attr-defined]
        if not hasattr(module, "deepspeed_moe_marker"):
            module.deepspeed_moe_marker = _deepspeed_moe_marker(
                module.router.num_experts, layout.ep, layout.expert_group_name
            )


def optimizer_param_groups(model: nn.Module, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = [
        {
            "params": [p for p in model.parameters() if p.requires_grad],
            "weight_decay": weight_decay,
            "name": "dense",
        }
    ]
    return split_params_into_different_moe_groups_for_optimizer(groups)
