"""`hc_post`: write a sub-block output back into the mHC streams.

    out[..., h, :] = post[..., h] * x[..., :] + sum_h' comb[..., h', h] * residual[..., h', :]

Note the transpose: `comb[h', h]` is the weight *from* old stream `h'` *to* new stream `h`
(HF: `torch.matmul(comb.transpose(-1, -2), residual)`).

Rounding follows HF's expression `post.to(dtype) * x + comb.to(dtype).T @ residual` in the activation dtype:
`post` and `comb` are rounded to the activation dtype first; the two terms are each accumulated in fp32 and
rounded to the activation dtype, then added (one more rounding). In fp32 every rounding is a no-op.

Backends (`backend=` per call; the model passes its config's `hc_post_impl`, see `glm53_ds/backends.py`):
  - `triton`: fused forward/backward kernels (`hc_post_triton.py`), the default on CUDA. The residual is read
    once per token and no `[..., n, D]` fp32 temporary exists.
  - `eager`: torch ops with fp32 accumulation over bounded chunks of tokens, so nothing larger than the output
    and one chunk's fp32 temporaries is allocated (no `[..., n, n, D]` intermediate). The default elsewhere.
    Inside a compiled region it is the same math as differentiable torch code (`hc_post_traced`), which inductor
    fuses into a few kernels without the `[..., n, n, D]` product. (The op's eager chunks, opaque to inductor, were
    13% of a compiled tiny step's profile on the CPU, as batched 4x4 matrix products; traced, that step's
    allocator peak went 73 -> 69 MiB and its time 0.292 -> 0.287 s, benchmarks/model_step.py.)
`triton` on CPU tensors needs `TRITON_INTERPRET=1` (Triton's interpreter), which is how CI runs the kernels.

Both backends sit behind one `torch.library.custom_op` (`glm53::hc_post`) with a fake implementation and
registered autograd, so `torch.compile(fullgraph=True)` treats the Triton kernels as one opaque node.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import backends

BACKENDS = ("eager", "triton")
MAX_HC_MULT_TRITON = 8


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


# Tokens per eager chunk are chosen so one chunk's fp32 temporaries stay near 4 MiB each, whatever the size.
EAGER_CHUNK_ELEMENTS = 1 << 20


def _token_slices(residual: torch.Tensor) -> list[slice]:
    """Slices over the flattened token dim of `residual [..., n, D]`, each about EAGER_CHUNK_ELEMENTS long."""
    n, d = residual.shape[-2:]
    row = max(n * d, 1)
    tokens, step = residual.numel() // row, max(1, EAGER_CHUNK_ELEMENTS // row)
    return [slice(t0, t0 + step) for t0 in range(0, tokens, step)]


def hc_post_forward_eager(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Forward without autograd. Peak extra memory: the output plus one token chunk's fp32 temporaries."""
    dtype = residual.dtype
    n, d = residual.shape[-2:]
    out = torch.empty(residual.shape, dtype=dtype, device=residual.device)
    x2, r3, p2, c3, o3 = (
        x.reshape(-1, d),
        residual.reshape(-1, n, d),
        post.reshape(-1, n),
        comb.reshape(-1, n, n),
        out.view(-1, n, d),
    )
    for sl in _token_slices(residual):
        post_c, comb_c = _rounded_weights(p2[sl], c3[sl], dtype)
        expanded = post_c.unsqueeze(-1) * x2[sl].float().unsqueeze(-2)  # [c, n, D]
        mixed = torch.matmul(comb_c.transpose(-1, -2), r3[sl].float())  # [c, n, n]^T @ [c, n, D] -> [c, n, D]
        torch.add(expanded.to(dtype), mixed.to(dtype), out=o3[sl])
    return out


def hc_post_backward_eager(
    grad_out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of x, residual, post, comb; fp32 accumulation, each returned in its input's dtype."""
    dtype = residual.dtype
    n, d = residual.shape[-2:]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_res = torch.empty(residual.shape, dtype=dtype, device=residual.device)
    grad_post = torch.empty(post.shape, dtype=post.dtype, device=post.device)
    grad_comb = torch.empty(comb.shape, dtype=comb.dtype, device=comb.device)
    g3, x2, r3 = grad_out.reshape(-1, n, d), x.reshape(-1, d), residual.reshape(-1, n, d)
    p2, c3 = post.reshape(-1, n), comb.reshape(-1, n, n)
    gx2, gr3, gp2, gc3 = (
        grad_x.view(-1, d),
        grad_res.view(-1, n, d),
        grad_post.view(-1, n),
        grad_comb.view(-1, n, n),
    )
    for sl in _token_slices(residual):
        post_c, comb_c = _rounded_weights(p2[sl], c3[sl], dtype)
        g = g3[sl].float()  # [c, n, D]
        gx2[sl] = torch.matmul(post_c.unsqueeze(-2), g).squeeze(-2)  # [c, 1, n] @ [c, n, D] -> [c, D]
        gr3[sl] = torch.matmul(comb_c, g)  # [c, n, n] @ [c, n, D]: sum_h comb[h', h] g[h]
        gp2[sl] = torch.matmul(g, x2[sl].float().unsqueeze(-1)).squeeze(-1)  # [c, n, D] @ [c, D, 1] -> [c, n]
        gc3[sl] = torch.matmul(r3[sl].float(), g.transpose(-1, -2))  # [h', h] = sum_d residual[h'] g[h]
    return grad_x, grad_res, grad_post, grad_comb


def hc_post_traced(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The eager backend's math and roundings as one differentiable expression, for a compiled region: in eager it
    would hold the [..., n, n, D] fp32 product that the chunks avoid; inductor sums it as it forms it."""
    dtype = residual.dtype
    post_c, comb_c = _rounded_weights(post, comb, dtype)
    expanded = post_c.unsqueeze(-1) * x.float().unsqueeze(-2)  # [..., n, D]
    mixed = (comb_c.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)  # sum_h' comb[h', h] residual[h']
    return expanded.to(dtype) + mixed.to(dtype)


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

    `backend`: "eager", "triton" or "auto" (the fused Triton kernels on CUDA, the eager path elsewhere);
    None means the configured default (`backends.default("hc_post_impl")`).
    """
    check_hc_post_inputs(x, residual, post, comb)
    backend = backends.resolve(
        backends.HC_POST, backends.default(backends.HC_POST) if backend is None else backend, x.device
    )
    if backend == "triton" and not 1 <= residual.shape[-2] <= MAX_HC_MULT_TRITON:
        raise ValueError(
            f"hc_post: the Triton kernel supports hc_mult 1..{MAX_HC_MULT_TRITON}, got {residual.shape[-2]}"
        )
    if backend == "eager" and torch.compiler.is_compiling():
        return hc_post_traced(x, residual, post, comb)
    return _hc_post_op(x, residual, post, comb, backend)


def hc_post_eager(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The eager path (fp32 accumulation, no `[..., n, n, D]` intermediate), differentiable, on any device."""
    return hc_post(x, residual, post, comb, backend="eager")
