"""The DSA sparse-attention core as custom ops, one per implementation, each with a fake (meta) implementation and
its backward registered: the model calls them the same way on CUDA, on CPU and on meta tensors (the dry run).

Contract (layers/sparse_attention.py): q_lat [b, L, h, R], latent [b, Lk, R], tokens [b, L, W] (indices into the Lk
keys, -1 = empty; Lk >= L) -> o_lat [b, L, h, R], rows without a valid slot 0.

- `glm53::sparse_attention_reference`: the torch reference (`sparse_attention.reference_forward` / `_backward`,
  blocks of `rows` query rows). Keeps q_lat, latent and tokens; recomputes each block in backward.
- `glm53::sparse_attention_triton`: the fused kernels (`sparse_attention_triton.sparse_forward` / `_backward`).
  Keeps also its output and the fp32 log-sum-exp [b, L, h]; its backward allocates the chunk buffers
  `dsa_workspace.backward_workspace` names (declared to the planner through `fused_kernels`).

The entry points check the contract's shapes on every device (`check_contract`, as the fake implementations do);
the fakes return the outputs' shapes; what each keeps for backward
is what its registered autograd saves, on every device, so the planner counts on meta what a GPU keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import fused_kernels
from .dsa_workspace import backward_workspace
from .fused_kernels import expect_shape

# Each implementation's (forward, backward), registered by the module that holds it when it is imported
# (sparse_attention.py: the reference; sparse_attention_triton.py, imported lazily: the kernels). This module imports
# neither: they import it.
IMPLEMENTATIONS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def check_contract(q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor) -> None:
    b, length, _, rank = q_lat.shape
    expect_shape("sparse attention latent", latent, (b, max(length, latent.shape[1]), rank))
    expect_shape("sparse attention tokens", tokens, (b, length, tokens.shape[-1]))


# --------------------------------------------------------------------------- the torch reference
@torch.library.custom_op("glm53::sparse_attention_reference", mutates_args=())
def _reference_op(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float, rows: int
) -> torch.Tensor:
    return IMPLEMENTATIONS["reference"][0](q_lat, latent, tokens, scaling, rows)


@_reference_op.register_fake
def _(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float, rows: int
) -> torch.Tensor:
    check_contract(q_lat, latent, tokens)
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)  # the blocks' output is contiguous


@torch.library.custom_op("glm53::sparse_attention_reference_backward", mutates_args=())
def _reference_backward_op(
    grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return IMPLEMENTATIONS["reference"][1](grad_out, q_lat, latent, tokens, scaling, rows)


@_reference_backward_op.register_fake
def _(
    grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format), torch.empty_like(latent)


def _reference_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q_lat, latent, tokens, scaling, rows = inputs
    ctx.save_for_backward(q_lat, latent, tokens)
    ctx.scaling, ctx.rows = scaling, rows


def _reference_grad(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q_lat, latent, tokens = ctx.saved_tensors
    dq, d_latent = _reference_backward_op(grad_out.contiguous(), q_lat, latent, tokens, ctx.scaling, ctx.rows)
    return dq, d_latent, None, None, None


_reference_op.register_autograd(_reference_grad, setup_context=_reference_setup)


# --------------------------------------------------------------------------- the fused Triton kernels
@torch.library.custom_op("glm53::sparse_attention_triton", mutates_args=())
def _triton_op(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return IMPLEMENTATIONS["triton"][0](q_lat, latent, tokens, scaling)


@_triton_op.register_fake
def _(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_contract(q_lat, latent, tokens)
    if tokens.dtype != torch.int32:
        raise ValueError(f"sparse attention tokens: dtype {tokens.dtype}, the kernel's contract needs int32")
    return torch.empty_like(q_lat), q_lat.new_empty(q_lat.shape[:3], dtype=torch.float32)


@torch.library.custom_op("glm53::sparse_attention_triton_backward", mutates_args=())
def _triton_backward_op(
    grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return IMPLEMENTATIONS["triton"][1](q_lat, latent, tokens, out, lse, grad_out, scaling)


@_triton_backward_op.register_fake
def _(
    grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format), torch.empty_like(latent)


def _triton_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q_lat, latent, tokens, scaling = inputs
    out, lse = output
    ctx.save_for_backward(q_lat, latent, tokens, out, lse)
    ctx.scaling = scaling


def _triton_grad(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor | None, ...]:
    q_lat, latent, tokens, out, lse = ctx.saved_tensors
    dq, d_latent = _triton_backward_op(grad_out.contiguous(), q_lat, latent, tokens, out, lse, ctx.scaling)
    return dq, d_latent, None, None


_triton_op.register_autograd(_triton_grad, setup_context=_triton_setup)


def _triton_workspace(grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor,
                      *_: Any) -> fused_kernels.Workspace:  # fmt: skip
    b, length, heads, rank = q_lat.shape
    return backward_workspace(
        b, length, heads, rank, tokens.shape[-1], q_lat.dtype, key_length=latent.shape[1]
    )


fused_kernels.register(fused_kernels.FusedKernel(
    "DSA sparse attention (Triton)", "glm53::sparse_attention_triton", "glm53::sparse_attention_triton_backward",
    _triton_workspace,
))  # fmt: skip
fused_kernels.register(
    fused_kernels.FusedKernel("DSA sparse attention (torch reference)", "glm53::sparse_attention_reference")
)


# --------------------------------------------------------------------------- entry points
def sparse_attention_reference(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float, rows: int
) -> torch.Tensor:
    """The torch reference in blocks of `rows` query rows: o_lat, differentiable in q_lat and latent."""
    check_contract(q_lat, latent, tokens)  # on every device, as the meta implementation does
    return _reference_op(q_lat, latent, tokens, float(scaling), int(rows))


def sparse_attention_fused(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The fused kernels (tokens int32): o_lat, differentiable in q_lat and latent."""
    check_contract(q_lat, latent, tokens)  # on every device, as the meta implementation does
    out, _ = _triton_op(q_lat, latent, tokens, float(scaling))
    return out
