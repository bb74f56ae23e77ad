"""`Glm53Engine`: what `build_engine` returns. The DeepSpeed engine and everything glm53_ds built around it.

DeepSpeed's engine object stays DeepSpeed's: glm53_ds sets no attributes of its own on it. The layout the model was
built under, HF's fp32-kept parameters (bf16 runs) and whether the ETP gradient pre-averaging was needed live here,
typed; the methods a training loop and the checkpoints use are named here and forward to DeepSpeed. `ds` is the
DeepSpeed engine itself, for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel.layout import ParallelLayout
from .deepspeed_internals import skip_next_update
from .fp32_params import Fp32Params


@dataclass(eq=False)
class Glm53Engine:
    ds: Any  # deepspeed.DeepSpeedEngine, with glm53_ds's patches installed (deepspeed_internals.py)
    layout: ParallelLayout
    fp32_params: Fp32Params | None = None  # bf16 runs: HF's fp32-kept parameters, outside DeepSpeed's cast
    gradient_sync: bool = False  # whether the ETP pre-averaging of replicated gradients was needed (ETP > 1)
    closed: bool = field(default=False, init=False)

    # ------------------------------------------------------------------ the training loop
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> None:
        """DeepSpeed's step (a no-op between accumulation boundaries); raises `NonFiniteGradientError` when the
        update was not applied because the global gradient norm was not finite."""
        self.ds.step()

    def skip_next_update(self) -> None:
        """The next accumulation boundary applies nothing and discards its gradients (a global batch without
        target tokens: weight decay and Adam's moments would still move every weight)."""
        skip_next_update(self.ds)

    def train(self, mode: bool = True) -> Glm53Engine:
        self.ds.train(mode)
        return self

    def eval(self) -> Glm53Engine:
        self.ds.eval()
        return self

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of every parameter group, the fp32-kept parameters' optimizer included."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.fp32_params is not None:
            self.fp32_params.set_lr(lr)

    def close(self) -> None:
        """Release the engine: DeepSpeed's gradient hooks hold its optimizer from C++ (a cycle Python's collector
        cannot see), so without this the engine, the model and their process groups' threads outlive every
        reference. The engine is not usable afterwards; a second call does nothing."""
        if not self.closed:
            self.ds.destroy()
            self.closed = True

    # ------------------------------------------------------------------ what it holds
    @property
    def module(self) -> Any:
        """The wrapped model (a `Glm53Model` in the trainer; any module `build_engine` took)."""
        return self.ds.module

    @property
    def optimizer(self) -> Any:
        return self.ds.optimizer

    @property
    def mpu(self) -> Any:
        return self.ds.mpu

    @property
    def device(self) -> torch.device:
        return self.ds.device

    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Every trained tensor by name: the model's trainable parameters, then the fp32-kept ones (bf16)."""
        named: list[tuple[str, torch.Tensor]] = [
            (n, p) for n, p in self.module.named_parameters() if p.requires_grad
        ]
        return named + (self.fp32_params.named if self.fp32_params is not None else [])

    # ------------------------------------------------------------------ DeepSpeed's state, read
    def get_global_grad_norm(self) -> float | None:
        return self.ds.get_global_grad_norm()

    def was_step_applied(self) -> bool:
        return bool(self.ds.was_step_applied())

    def is_gradient_accumulation_boundary(self) -> bool:
        return bool(self.ds.is_gradient_accumulation_boundary())

    def zero_optimization_stage(self) -> int:
        return int(self.ds.zero_optimization_stage())

    def gradient_clipping(self) -> float:
        return float(self.ds.gradient_clipping())

    def bfloat16_enabled(self) -> bool:
        return bool(self.ds.bfloat16_enabled())

    def fp16_enabled(self) -> bool:
        return bool(self.ds.fp16_enabled())
