"""Parallel concerns: process groups, megatron `parallel_state`, DeepSpeed wiring. Model code does not import
DeepSpeed; it reads its groups from megatron's `parallel_state`."""

from .state import ensure_model_parallel

__all__ = ["ensure_model_parallel"]
