"""Kimi delta attention (KDA) core: the gated delta rule with per-channel decay, computed chunk by chunk.

Per head, with state S [dk, dv], per-channel log-decay g_t [dk], write strength beta_t and l2-normalised q, k:
    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T
    o_t = S_t^T (q_t / sqrt(dk))
The chunked form (chunk length C) solves each chunk's intra-chunk dependencies with one unit-lower-triangular
system (the WY representation) and carries S across chunks; its pairwise decays exp(G_i - G_j) materialise only
inside 16-token sub-chunks (`_decayed_products`). Everything runs in fp32 (the state is sensitive to
rounding); the output is cast back to the input dtype.

`kda_attention` uses fla-core's Triton kernel on CUDA when `fla` is installed (the config's `kda_impl`:
`fla|torch|auto`, see `glm53_ds/backends.py`); the torch path here is the reference it is checked against.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from .. import backends
from . import fused_kernels
from .documents import Documents
from .fused_kernels import expect_shape

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's convention: x / sqrt(sum(x^2) + eps) (eps inside the root, unlike F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """q, k, g `[b, s, h, dk]`, v `[b, s, h, dv]`, beta `[b, s, h]` -> o `[b, s, h, dv]` in q's dtype.

    q and k are l2-normalised here (in fp32), as FLA's `use_qk_l2norm_in_kernel=True`. `document_ids` `[s]`
    (packed documents, each token's document, non-decreasing): the state restarts at each document, in tensor code
    over the row's own chunks (a compiled layer traces it once for any packing): inside a chunk a position
    interacts only with positions of its document, the carried state reaches only the positions of the document
    it carries, and a chunk hands on the state of its last document alone.
    """
    out_dtype = q.dtype
    # [b, s, h, d] -> [b, h, s, d], fp32
    q, k, v, g = (t.transpose(1, 2).float() for t in (q, k, v, g))
    beta = beta.transpose(1, 2).float()
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    # whole sub-chunks: positions after the row write nothing (k = beta = 0) and do not decay (g = 0)
    tail = -s % SUB_CHUNK
    if tail:
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, tail)) for t in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, tail))
        if document_ids is not None:
            document_ids = torch.cat([document_ids, document_ids[-1:].expand(tail)])

    state = q.new_zeros(b, h, dk, dv)
    outputs = []
    for start in range(0, s + tail, chunk_size):
        end = min(start + chunk_size, s + tail)
        c = end - start
        qc, kc, vc, bc = (
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            beta[:, :, start:end, None],
        )
        gc = g[:, :, start:end].cumsum(dim=-2)  # [b, h, c, dk], log decay from the chunk start
        g_last = gc[:, :, -1:]  # [b, h, 1, dk]

        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
        carried = kept = in_last = None
        if document_ids is not None:
            ids = document_ids[start:end]
            causal = causal & (ids[:, None] == ids[None, :])  # and of one document
            # the state entering the chunk is the document of the token before it (none before the first chunk)
            entering = document_ids[max(start - 1, 0)]
            carried = (ids == entering)[:, None]  # [c, 1]: positions the carried state reaches
            in_last = (ids == ids[-1])[:, None]  # [c, 1]: the document whose state the chunk hands on
            kept = ids[-1] == entering  # that document is the carried one (no document began in the chunk)
        strictly_lower = causal.tril(-1)  # j < i

        # Intra-chunk write interactions A[i, j] = -beta_i sum_d k_i k_j decay_ij (j < i), and the WY solve
        # (I - A) X = rhs: X = T @ rhs with T = (I - A)^-1; the scores q_i . k_j decay_ij (j <= i).
        kb = kc * bc
        writes, scores = _decayed_products(torch.stack([kb, qc]), kc, gc)  # writes = -A before its mask
        scores = scores.masked_fill(~causal, 0.0)  # [b, h, c, c]
        system = torch.eye(c, dtype=writes.dtype, device=writes.device) + writes.masked_fill(
            ~strictly_lower, 0.0
        )
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)  # [b, h, c, dv]
        from_start = gc.exp()  # [b, h, c, dk]: the decay since the chunk's start
        if carried is not None:
            from_start = from_start * carried  # the carried state meets no other document
        w = torch.linalg.solve_triangular(
            system, kb * from_start, upper=False, unitriangular=True
        )  # [b, h, c, dk]

        v_new = u - w @ state  # what each position writes, after the carried state's prediction
        outputs.append((qc * from_start) @ state + scores @ v_new)
        to_end = kc * (g_last - gc).exp()  # [b, h, c, dk]
        decayed = state * g_last.exp().transpose(-1, -2)
        if in_last is not None and kept is not None:
            to_end = to_end * in_last  # only the last document's writes reach the next chunk
            decayed = decayed * kept  # its state starts from zero when it began in this chunk
        state = decayed + to_end.transpose(-1, -2) @ v_new

    o = torch.cat(outputs, dim=2)[:, :, :s] if outputs else v.new_zeros(b, h, 0, dv)
    return o.transpose(1, 2).contiguous().to(out_dtype)


SUB_CHUNK = 16


def _decayed_products(lhs: torch.Tensor, rhs: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    """sum_d lhs[i, d] rhs[j, d] exp(gc[i, d] - gc[j, d]) for j <= i (0 above the diagonal): lhs [..., c, dk]
    (any leading dims broadcasting against rhs's), rhs and gc (the log decay since the chunk's start,
    non-increasing in i) [b, h, c, dk], c a multiple of SUB_CHUNK -> [..., c, c].

    Materialising exp(gc_i - gc_j) for every pair is a [c, c, dk] tensor per head. Instead, a pair whose j lies in
    an earlier sub-chunk than i factors through the start r of i's sub-chunk,
    exp(gc_i - gc_j) = exp(gc_i - gc_r) exp(gc_r - gc_j), both exponents <= 0 (each factor at most 1), so those pairs are one
    matrix product; only pairs inside a sub-chunk materialise their decay ([c, SUB_CHUNK, dk] per head), as fla's
    kernels split a chunk into sub-chunks of 16."""
    c = gc.shape[-2]
    n = c // SUB_CHUNK
    by_sub = (n, SUB_CHUNK)
    g_sub = gc.unflatten(-2, by_sub)  # [b, h, n, sub, dk]
    g_ref = g_sub[..., :1, :]  # [b, h, n, 1, dk]: the log decay at each sub-chunk's start
    lhs_sub, rhs_sub = lhs.unflatten(-2, by_sub), rhs.unflatten(-2, by_sub)
    # pairs across sub-chunks: [..., n, sub, dk] @ [b, h, n, dk, c], the columns j before sub-chunk p's start
    # decayed to it (to_ref [b, h, n, c, dk]), the others 0
    positions = torch.arange(c, device=gc.device)
    earlier = (positions[None, :] < positions[::SUB_CHUNK, None])[..., None]  # [n, c, 1]
    to_ref = (g_ref - gc[:, :, None]).masked_fill(~earlier, float("-inf")).exp()
    from_ref = (g_sub - g_ref).exp()  # [b, h, n, sub, dk]
    across = (lhs_sub * from_ref) @ (rhs[:, :, None] * to_ref).transpose(-1, -2)  # [..., n, sub, c]
    # pairs inside a sub-chunk: the decay materialised, [b, h, n, sub, sub, dk]
    inner_causal = torch.ones(SUB_CHUNK, SUB_CHUNK, dtype=torch.bool, device=gc.device).tril()[..., None]
    inner_decay = (g_sub.unsqueeze(-2) - g_sub.unsqueeze(-3)).masked_fill(~inner_causal, float("-inf")).exp()
    inner = (lhs_sub.unsqueeze(-2) * rhs_sub.unsqueeze(-3) * inner_decay).sum(-1)  # [..., n, sub, sub]
    # inner's blocks on the diagonal of [n, sub, n, sub], where `across` is 0
    on_diagonal = torch.eye(n, dtype=inner.dtype, device=inner.device)
    blocks = (inner.unsqueeze(-2) * on_diagonal[:, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return across.flatten(-3, -2) + blocks


# --------------------------------------------------------------------------- the reference as an operator
# `glm53::kda_reference`: one operator whose kernels the dispatcher picks by device, so the model calls it the same
# way everywhere. On CPU and CUDA it is the torch reference above, through autograd as written (no recompute: the
# reference has no backward of its own to put behind a custom op). On meta tensors (the dry run) it is the kernel's
# contract: outputs like v, the inputs kept for backward as fla's kernel keeps them, gradients shaped as the inputs,
# and the op itself visible to a dispatch mode (the planner records the kernel's operands there).
def check_contract(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> None:
    b, s, h, dk = q.shape
    expect_shape("KDA k", k, (b, s, h, dk))
    expect_shape("KDA g", g, (b, s, h, dk))
    expect_shape("KDA beta", beta, (b, s, h))
    expect_shape("KDA v", v, (b, s, h, v.shape[-1]))


class _ContractOnMeta(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(q, k, v, g, beta)
        with torch._C._AutoDispatchBelowAutograd():  # to the Meta kernel, through any dispatch mode
            return torch.ops.glm53.kda_reference(q, k, v, g, beta, document_ids)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*(torch.empty_like(t) for t in ctx.saved_tensors), None)


_LIBRARY = torch.library.Library("glm53", "FRAGMENT")
_LIBRARY.define(
    "kda_reference(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? document_ids=None) -> Tensor"
)
for _key in ("CPU", "CUDA", "AutogradCPU", "AutogradCUDA"):
    _LIBRARY.impl("kda_reference", chunk_kda_torch, _key)
_LIBRARY.impl("kda_reference", _ContractOnMeta.apply, "AutogradMeta")
_LIBRARY.impl(
    "kda_reference", lambda q, k, v, g, beta, document_ids=None: torch.empty_like(v, dtype=q.dtype), "Meta"
)
fused_kernels.register(fused_kernels.FusedKernel("KDA (fla chunk_kda)", "glm53::kda_reference"))


def kda_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The torch reference through its op: o [b, s, h, dv] in q's dtype, differentiable in every input;
    `document_ids` [s]: packed documents (`chunk_kda_torch`)."""
    check_contract(q, k, v, g, beta)
    if document_ids is not None:
        expect_shape("KDA document_ids", document_ids, (q.shape[1],))
    return torch.ops.glm53.kda_reference(q, k, v, g, beta, document_ids)


@functools.cache
def _takes_cu_seqlens_cpu(chunk_kda: Any) -> bool:
    """Whether this fla-core's `chunk_kda` takes `cu_seqlens_cpu` (fla PR #775: the chunk indices of packed
    documents built from host boundaries, without reading `cu_seqlens` back from the GPU)."""
    try:
        return "cu_seqlens_cpu" in inspect.signature(chunk_kda).parameters
    except (TypeError, ValueError):
        return False


def kda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    backend: str = "auto",
    documents: Documents | None = None,
) -> torch.Tensor:
    """`backend` (the config's `kda_impl`): fla-core's chunked KDA kernel, the torch reference, or `auto` (fla on
    CUDA when installed). `documents` (batch 1): the state restarts at each document, through fla's varlen kernel
    (`cu_seqlens`) or the torch reference over the whole row with each token's document (`documents.ids`): tensor
    code whose shapes do not depend on the documents, which a compiled layer traces once."""
    if backends.resolve(backends.KDA, backend, q.device) == "fla":
        from fla.ops.kda import chunk_kda

        varlen: dict[str, torch.Tensor] = {}
        if documents is not None:
            varlen["cu_seqlens"] = documents.cu_seqlens.to(device=q.device, dtype=torch.long)
            # the boundaries the host knows: fla builds its chunk indices without reading them back
            if _takes_cu_seqlens_cpu(chunk_kda):
                varlen["cu_seqlens_cpu"] = documents.cu_seqlens_host
        out, _ = chunk_kda(q=q, k=k, v=v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True, **varlen)
        return out.to(q.dtype)
    return kda_reference(q, k, v, g, beta, None if documents is None else documents.ids)
