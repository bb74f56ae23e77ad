"""Sigmoid-routed MoE with a shared expert (HF `Glm5NextTextMoE`)."""

from .experts import GroupedExperts
from .moe_layer import Glm53MoE
from .router import TopKRouter

__all__ = ["Glm53MoE", "GroupedExperts", "TopKRouter"]
