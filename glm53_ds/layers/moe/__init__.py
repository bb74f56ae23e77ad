"""Sigmoid-routed MoE with a shared expert (HF `Glm5NextTextMoE`) and its aux-loss-free load balancing."""

from .experts import GroupedExperts
from .moe_layer import Glm53MoE
from .router import TopKRouter
from .router_balance import update_router_bias

__all__ = ["Glm53MoE", "GroupedExperts", "TopKRouter", "update_router_bias"]
