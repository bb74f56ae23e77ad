"""`hc_post`: write a sub-block output back into the mHC streams.

    out[..., h, :] = post[..., h] * x[..., :] + sum_h' comb[..., h', h] * residual[..., h', :]

Note the transpose: `comb[h', h]` is the weight *from* old stream `h'` *to* new stream `h`
(HF: `torch.matmul(comb.transpose(-1, -2), residual)`).

Rounding follows HF's expression `post.to(dtype) * x + comb.to(dtype).T @ residual` in the activation dtype:
`post` and `comb` are rounded to the activation dtype first; the two terms are each accumulated in fp32 and
rounded to the activation dtype, then added (one more rounding). In fp32 every rounding is a no-op.

Backends, chosen per call:
  - `triton`: fused forward/backward kernels (`hc_post_triton.py`), the default on CUDA. The residual is read
    once per token and no `[..., n, D]` fp32 temporary exists.
  - `eager`: torch ops with fp32 accumulation, one output stream at a time, so nothing larger than the output
    and a few `[..., D]` fp32 rows is allocated (no `[..., n, n, D]` intermediate). The default elsewhere.
`GLM53_HC_POST=eager|triton|auto` forces a path; `triton` on CPU tensors needs `TRITON_INTERPRET=1`
(Triton's interpreter), which is how CI runs the kernels.

Both backends sit behind one `torch.library.custom_op` (`glm53::hc_post`) with a fake implementation and
registered autograd, so `torch.compile(fullgraph=True)` treats it as one opaque node on any device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

BACKEND_ENV = "GLM53_HC_POST"
BACKENDS = ("eager", "triton")
MAX_HC_MULT_TRITON = 8


# --------------------------------------------------------------------------- backend selection
def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(x: torch.Tensor) -> str:
    """The backend `hc_post` uses for a tensor on `x.device`, honouring `GLM53_HC_POST`."""
    forced = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if forced == "auto":
        return "triton" if x.is_cuda and _triton_importable() else "eager"
    if forced not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of 'eager', 'triton', 'auto'")
    if forced == "triton":
        if not _triton_importable():
            raise RuntimeError(f"{BACKEND_ENV}=triton but the triton package cannot be imported")
        if not x.is_cuda and not triton_interpreter_enabled():
            raise RuntimeError(
                f"{BACKEND_ENV}=triton on a {x.device.type} tensor needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
            )
    return forced


# --------------------------------------------------------------------------- input checks
def check_hc_post_inputs(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> None:
    if residual.dim() < 2:
        raise ValueError(f"hc_post: residual must be [..., n, D], got shape {tuple(residual.shape)}")
    *lead, n, d = residual.shape
    lead_t = tuple(lead)
    expected = {"x": (*lead_t, d), "post": (*lead_t, n), "comb": (*lead_t, n, n)}
    for name, t in (("x", x), ("post", post), ("comb", comb)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"hc_post: {name} has shape {tuple(t.shape)}, expected {expected[name]} for residual "
                f"{tuple(residual.shape)}"
            )
    for name, t in (("x", x), ("residual", residual), ("post", post), ("comb", comb)):
        if not t.is_floating_point():
            raise TypeError(f"hc_post: {name} must be a floating-point tensor, got {t.dtype}")
    if x.dtype != residual.dtype:
        raise TypeError(
            f"hc_post: x ({x.dtype}) and residual ({residual.dtype}) must share the activation dtype"
        )
    devices = {t.device for t in (x, residual, post, comb)}
    if len(devices) != 1:
        raise ValueError(f"hc_post: all inputs must be on one device, got {sorted(str(d) for d in devices)}")


# --------------------------------------------------------------------------- eager math
def _rounded_weights(
    post: torch.Tensor, comb: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rounds post/comb to the activation dtype before use; arithmetic then runs in fp32."""
    return post.to(dtype).float(), comb.to(dtype).float()


def hc_post_forward_eager(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Forward without autograd, one output stream at a time (peak extra memory: the output + a few fp32 rows)."""
    dtype = residual.dtype
    n = residual.shape[-2]
    post_c, comb_c = _rounded_weights(post, comb, dtype)
    out = torch.empty(residual.shape, dtype=dtype, device=residual.device)
    for h in range(n):
        # sum_h' comb[h', h] * residual[h'] in fp32 (bf16 residual rows promote inside the ops, no full copy)
        mixed = comb_c[..., 0, h, None] * residual[..., 0, :]
        for hp in range(1, n):
            mixed.addcmul_(comb_c[..., hp, h, None], residual[..., hp, :])
        expanded = post_c[..., h, None] * x
        torch.add(expanded.to(dtype), mixed.to(dtype), out=out[..., h, :])
    return out


def hc_post_backward_eager(
    grad_out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of x, residual, post, comb; fp32 accumulation, each returned in its input's dtype."""
    dtype = residual.dtype
    post_c, comb_c = _rounded_weights(post, comb, dtype)
    g = grad_out.float()  # [..., n, D]
    grad_x = torch.matmul(post_c.unsqueeze(-2), g).squeeze(-2)  # [..., 1, n] @ [..., n, D] -> [..., D]
    grad_residual = torch.matmul(comb_c, g)  # [..., n, n] @ [..., n, D]: sum_h comb[h', h] g[h]
    grad_post = torch.matmul(g, x.float().unsqueeze(-1)).squeeze(-1)  # [..., n, D] @ [..., D, 1] -> [..., n]
    grad_comb = torch.matmul(residual.float(), g.transpose(-1, -2))  # [h', h] = sum_d residual[h'] g[h]
    return grad_x.to(x.dtype), grad_residual.to(dtype), grad_post.to(post.dtype), grad_comb.to(comb.dtype)


def hc_post_hf_expression(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """HF's residual update, verbatim (the reference for tests and benchmarks; not used by the model)."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * x.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual
    )


# --------------------------------------------------------------------------- the custom op
@torch.library.custom_op("glm53::hc_post", mutates_args=())
def _hc_post_op(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, backend: str
) -> torch.Tensor:
    if backend == "triton":
        from . import hc_post_triton

        return hc_post_triton.hc_post_forward(x, residual, post, comb)
    return hc_post_forward_eager(x, residual, post, comb)


@_hc_post_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, backend: str
) -> torch.Tensor:
    return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)


@torch.library.custom_op("glm53::hc_post_backward", mutates_args=())
def _hc_post_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from . import hc_post_triton

        return hc_post_triton.hc_post_backward(grad_out, x, residual, post, comb)
    return hc_post_backward_eager(grad_out, x, residual, post, comb)


@_hc_post_backward_op.register_fake
def _(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
        torch.empty(post.shape, dtype=post.dtype, device=post.device),
        torch.empty(comb.shape, dtype=comb.dtype, device=comb.device),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, residual, post, comb, backend = inputs
    ctx.save_for_backward(x, residual, post, comb)
    ctx.backend = backend


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, residual, post, comb = ctx.saved_tensors
    grads = _hc_post_backward_op(grad_out.contiguous(), x, residual, post, comb, ctx.backend)
    return (*grads, None)


_hc_post_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public entry points
def hc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """`x [..., D]`, `residual [..., n, D]`, `post [..., n]`, `comb [..., n, n]` -> new streams `[..., n, D]`.

    `backend=None` picks the fused Triton kernels on CUDA and the eager path elsewhere (`GLM53_HC_POST`
    overrides); pass `"eager"` or `"triton"` to force one.
    """
    check_hc_post_inputs(x, residual, post, comb)
    if backend is None:
        backend = resolve_backend(x)
    elif backend not in BACKENDS:
        raise ValueError(f"hc_post: backend={backend!r}, expected one of {BACKENDS}")
    if backend == "triton" and not 1 <= residual.shape[-2] <= MAX_HC_MULT_TRITON:
        raise ValueError(
            f"hc_post: the Triton kernel supports hc_mult 1..{MAX_HC_MULT_TRITON}, got {residual.shape[-2]}"
        )
    return _hc_post_op(x, residual, post, comb, backend)


def hc_post_eager(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The eager path (fp32 accumulation, no `[..., n, n, D]` intermediate), differentiable, on any device."""
    return hc_post(x, residual, post, comb, backend="eager")
