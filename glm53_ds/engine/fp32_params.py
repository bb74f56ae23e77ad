"""HF's fp32-kept parameters in a bf16 DeepSpeed run: fp32 in the forward pass, their own reduction and optimizer.

transformers keeps `conv1d`, `dt_bias`, `A_log` and the mHC `base` / `scale` in fp32 inside a bf16 model
(`Glm53Model._keep_in_fp32_modules_strict`). DeepSpeed 0.19.8 casts every parameter to the training dtype and
flattens it into ZeRO's buffers (it keeps only buffers in fp32), so `Fp32Params` takes them out of its sight before
`deepspeed.initialize`:
  - each becomes a persistent buffer of its module, fp32, with `requires_grad` (same state-dict name, so
    checkpoints, exports and replica checks see it as before; DeepSpeed never casts, flattens or partitions it);
  - at each optimizer step (`deepspeed_internals.install_fp32_params` wraps `engine.step`): the gradients, which
    accumulated over the micro-batches with DeepSpeed's 1/GAS loss scaling, are reduced over the world (their
    replica group, the same rule as every replicated parameter: summed over SP ranks, averaged over the rest) in
    one flat all-reduce; their squared norm joins
    DeepSpeed's global norm exactly once; after DeepSpeed's step they are clipped by the same coefficient and
    updated by an fp32 optimizer of the same type and hyperparameters (built by the same factory, so the same
    weight-decay rule; the learning rate is set with the rest by `set_learning_rate`);
  - its optimizer state is saved and resumed with the checkpoint (`state_dict` / `load_state_dict`).
A frozen one (a LoRA run's base: `requires_grad=False` when the engine is built) becomes an fp32 buffer the same
way and stays out of everything else: no gradient, no optimizer state (`frozen`).
Nothing here imports DeepSpeed; the hooks into its optimizers live in `deepspeed_internals.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model import fp32_kept_names


class Fp32Params:
    def __init__(self, model: nn.Module) -> None:
        """Turn the fp32-kept parameters of `model` into fp32 buffers (before the engine is built)."""
        self.slots: list[tuple[str, nn.Module, str]] = []
        modules = dict(model.named_modules())
        self.frozen: list[
            str
        ] = []  # kept in fp32 too, but not trained (a LoRA run's base): no optimizer state
        for name in fp32_kept_names(model):
            owner_name, _, attr = name.rpartition(".")
            owner = modules[owner_name]
            param = owner._parameters.pop(attr)
            assert param is not None
            # no grad while DeepSpeed initialises (it may move or broadcast module tensors); `finish` re-enables it
            owner.register_buffer(attr, param.detach().float().clone(), persistent=True)
            if param.requires_grad:
                self.slots.append((name, owner, attr))
            else:
                self.frozen.append(name)
        self.optimizer: torch.optim.Optimizer | None = None
        self.sequence_parallel = 1  # SP shards of one sample: their gradients add up (set from the layout)
        self._square_norm: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [owner._buffers[attr] for _, owner, attr in self.slots]  # type: ignore[misc]

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip([n for n, _, _ in self.slots], self.tensors, strict=True))

    def finish(self, make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
               groups: Callable[[list[tuple[str, torch.Tensor]]], list[dict[str, Any]]]) -> None:  # fmt: skip
        """After `deepspeed.initialize`: make each tensor a leaf that takes gradients, and build its optimizer with
        the engine's factory over `groups(named tensors)` (the engine's weight-decay grouping)."""
        for _, owner, attr in self.slots:
            owner._buffers[attr] = owner._buffers[attr].detach().requires_grad_(True)  # type: ignore[union-attr]
        self.optimizer = make_optimizer(groups(self.named))

    # ------------------------------------------------------------------ one optimizer step
    def reduce(self) -> torch.Tensor:
        """Sum the gradients over the world, divided by world / SP (SP shards of one sample add up, samples
        average; one flat all-reduce); returns their squared norm (fp32, 0-d), kept for DeepSpeed's global norm."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.tensors]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
            flat /= dist.get_world_size() // self.sequence_parallel
        offset = 0
        for t, g in zip(self.tensors, grads, strict=True):
            t.grad = flat[offset : offset + g.numel()].view_as(t).clone()
            offset += g.numel()
        self._square_norm = flat.double().square().sum().float()
        return self._square_norm

    @property
    def square_norm(self) -> torch.Tensor | None:
        """The squared norm of the reduced gradients during the step that is under way, else None."""
        return self._square_norm

    def clip_and_step(self, total_norm: float, max_norm: float) -> None:
        """Clip by the global norm as DeepSpeed clips its own gradients, then update."""
        assert self.optimizer is not None
        if max_norm > 0:
            clip = (total_norm + 1e-6) / max_norm
            if clip > 1:
                for t in self.tensors:
                    if t.grad is not None:
                        t.grad.div_(clip)
        self.optimizer.step()

    def zero_grad(self) -> None:
        for t in self.tensors:
            t.grad = None
        self._square_norm = None

    def set_lr(self, lr: float) -> None:
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state)
