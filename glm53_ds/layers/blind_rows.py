"""Blind rows: HF's attention output and gradient for a query allowed no key.

HF masks a disallowed key with finfo.min, so a query allowed nothing (a padding position, or one of the first
kpool - 1 tokens of a document when the tail is not selected) gets min + score == min on every key: its forward is
the uniform average of all values, while the gradient still flows to q and k through the add (the softmax Jacobian
at the uniform point). "All values" are those of the query's sequence: the row's, or in a packed row its
document's (`blind_rows_by_document`).

A blind row r sees p = softmax(x - x.detach()) = 1/L over all L keys: its value is the mean v̄ of the values.
Its gradient is the softmax Jacobian at the uniform point, dx_j = (g · (v_j - v̄)) / L with x_j = q · k_j · c:
  dq_r = c · C g_r,                   C = (1/L) Σ_j k_j (v_j - v̄)^T     (the keys' and values' covariance)
  dk_j = (c / L) · N (v_j - v̄),       N = Σ_r q_r g_r^T over blind rows
  dv_j = (1 / L) Σ_r g_r
C and N are [d, dv] per (batch, key head): the backward costs O((s + L) · heads · d · dv), at least in fp32, with
no host sync and no compaction of the blind rows (`_BlindRows`, every row at once).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _blind_value(out: torch.Tensor, blind: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """out [b, s, h, dv] with the blind rows ([b, s]) the mean of values [b, L, h or 1, dv]."""
    mean = values.to(torch.promote_types(values.dtype, torch.float32)).mean(1, keepdim=True).to(out.dtype)
    return torch.where(blind[:, :, None, None], mean, out)


def _blind_gradients(
    grad: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    scaling: float, need_q: bool = True, need_k: bool = True, need_v: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """The blind rows' (dq, dk, dv) in closed form (the module docstring): grad [b, s, h, dv] the output's."""
    c, length, heads = scaling, keys.shape[1], q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    g = grad.to(dtype).masked_fill(~blind[:, :, None, None], 0.0)  # [b, s, h, dv]: the blind rows' gradient
    k, v = keys.to(dtype), values.to(dtype)
    v_centered = v - v.mean(1, keepdim=True)  # [b, L, hk, dv]
    d_q = d_k = d_v = None
    if need_q:
        cov = torch.einsum("blhd,blhe->bhde", k, v_centered) / length  # [b, hk, d, dv]
        d_q = (c * torch.einsum("bshe,bhde->bshd", g, cov.expand(-1, heads, -1, -1))).to(q.dtype)
    if need_k:
        n = torch.einsum("bshd,bshe->bhde", q.to(dtype), g)  # [b, h, d, dv]
        if keys.shape[2] != heads:  # keys shared by the heads
            n = n.sum(1, keepdim=True)
        d_k = (c / length * torch.einsum("bhde,blhe->blhd", n, v_centered)).to(keys.dtype)
    if need_v:
        total = g.sum(1, keepdim=True)  # [b, 1, h, dv]
        if values.shape[2] != heads:
            total = total.sum(2, keepdim=True)
        d_v = (total / length).expand_as(values).to(values.dtype)
    return d_q, d_k, d_v


class _BlindRows(torch.autograd.Function):
    """HF's value and gradient on blind rows in closed form, for every row at once (no host sync, no compaction)."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        blind: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        # values None: the keys are the values (the latent form), one input (torch.compile refuses the same
        # tensor twice in an autograd.Function), its gradient the sum of both
        ctx.shared = values is None
        values = keys if values is None else values
        ctx.save_for_backward(blind, q, keys, values)
        ctx.scaling = scaling
        return _blind_value(out, blind, values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        blind, q, keys, values = ctx.saved_tensors
        need = ctx.needs_input_grad
        d_q, d_k, d_v = _blind_gradients(
            grad, blind, q, keys, values, ctx.scaling, need[2], need[3], need[4] or (ctx.shared and need[3])
        )
        # shared: as autograd would sum the two uses' gradients
        if ctx.shared and d_k is not None and d_v is not None:
            d_k, d_v = d_k + d_v, None
        elif ctx.shared:
            d_k, d_v = None, None
        return grad.masked_fill(blind[:, :, None, None], 0.0), None, d_q, d_k, d_v, None


def blind_rows(
    out: torch.Tensor,
    blind: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    dropout: float,
) -> torch.Tensor:
    """`out` [b, s, h, dv] with the rows of queries allowed nothing (`blind` [b, s]) replaced by HF's value there.
    q [b, s, h, d], keys [b, L, h or 1, d], values [b, L, h or 1, dv] (the dense path's per-head k, v; the latent
    form's latent for both). Without attention dropout: `_BlindRows`, closed form, no host sync. With dropout (its
    mask is drawn per blind row): softmax(x - x.detach()) v on the blind rows found on the host (one sync)."""
    if dropout == 0.0:
        return _BlindRows.apply(out, blind, q, keys, None if values is keys else values, scaling)
    if not blind.any():
        return out
    batch_index, query_index = blind.nonzero(as_tuple=True)  # sorted by batch element, then position
    rows = []
    for i in batch_index.unique().tolist():
        queries = query_index[batch_index == i]
        x = torch.matmul(q[i, queries].transpose(0, 1), keys[i].permute(1, 2, 0)) * scaling  # [h, n, L]
        probs = F.softmax(x - x.detach(), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).to(
            q.dtype
        )
        probs = F.dropout(probs, p=dropout, training=True)
        rows.append(torch.matmul(probs, values[i].transpose(0, 1)).transpose(0, 1))  # [n, h, dv]
    return out.index_put((batch_index, query_index), torch.cat(rows))


# --- packed rows: each blind query averages its own document -------------------------------------------------------


def _local_documents(
    document_ids: torch.Tensor, query_offset: int, rows: int
) -> list[tuple[int, int, slice]]:
    """The documents [a, e) of a packed row (`document_ids` [L], one host read) holding some of the queries
    [query_offset, query_offset + rows), each with those queries' local rows."""
    counts = torch.unique_consecutive(document_ids, return_counts=True)[1].tolist()
    found, a = [], 0
    for n in counts:
        e = a + n
        lo, hi = max(a, query_offset), min(e, query_offset + rows)
        if lo < hi:
            found.append((a, e, slice(lo - query_offset, hi - query_offset)))
        a = e
    return found


@torch.library.custom_op("glm53::blind_rows_by_document", mutates_args=())
def _by_document(
    out: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float,
) -> torch.Tensor:  # fmt: skip
    result = out.clone(memory_format=torch.contiguous_format)
    for a, e, rows in _local_documents(document_ids, query_offset, out.shape[1]):
        result[:, rows] = _blind_value(out[:, rows], blind[:, rows], latent[:, a:e].unsqueeze(2))
    return result


@_by_document.register_fake
def _(
    out: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(out, memory_format=torch.contiguous_format)


@torch.library.custom_op("glm53::blind_rows_by_document_backward", mutates_args=())
def _by_document_backward(
    grad: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    d_q = torch.zeros_like(q, memory_format=torch.contiguous_format)
    d_latent = torch.zeros_like(latent, memory_format=torch.contiguous_format)
    for a, e, rows in _local_documents(document_ids, query_offset, grad.shape[1]):
        keys = latent[:, a:e].unsqueeze(2)  # [b, L_d, 1, R]: K = V, shared by the heads
        dq, dk, dv = _blind_gradients(grad[:, rows], blind[:, rows], q[:, rows], keys, keys, scaling)
        assert dq is not None and dk is not None and dv is not None
        d_q[:, rows] = dq
        d_latent[:, a:e] += (dk + dv).squeeze(2)
    return grad.masked_fill(blind[:, :, None, None], 0.0).contiguous(), d_q, d_latent


@_by_document_backward.register_fake
def _(
    grad: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return (
        torch.empty_like(grad, memory_format=torch.contiguous_format),
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(latent, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, blind, q, latent, document_ids, query_offset, scaling = inputs
    ctx.save_for_backward(blind, q, latent, document_ids)
    ctx.query_offset, ctx.scaling = query_offset, scaling


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    blind, q, latent, document_ids = ctx.saved_tensors
    d_out, d_q, d_latent = _by_document_backward(
        grad, blind, q, latent, document_ids, ctx.query_offset, ctx.scaling
    )
    return d_out, None, d_q, d_latent, None, None, None


_by_document.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.disable
def _by_document_with_dropout(
    out: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float, dropout: float,
) -> torch.Tensor:  # fmt: skip
    """With attention dropout: `blind_rows` per document, through autograd (host syncs: eager under compile)."""
    parts = []
    for a, e, rows in _local_documents(document_ids, query_offset, out.shape[1]):
        keys = latent[:, a:e].unsqueeze(2)
        parts.append(blind_rows(out[:, rows], blind[:, rows], q[:, rows], keys, keys, scaling, dropout))
    return torch.cat(parts, dim=1)


def blind_rows_by_document(
    out: torch.Tensor, blind: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, document_ids: torch.Tensor,
    query_offset: int, scaling: float, dropout: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`blind_rows` in the latent form (K = V = latent [b, L, R], b = 1) over a packed row: a blind query (q [b, s,
    h, R], queries at keys `query_offset ...`) averages the values of its own document (`document_ids` [L], each
    key's document). One op (`glm53::blind_rows_by_document`) with its closed-form backward, opaque to a compiled
    graph (its shapes do not depend on the packing); inside, one host read of the document boundaries."""
    if dropout == 0.0:
        return _by_document(out, blind, q, latent, document_ids, int(query_offset), float(scaling))
    return _by_document_with_dropout(out, blind, q, latent, document_ids, query_offset, scaling, dropout)
