"""Packed documents: one row `[1, T]` holding several documents, each computed exactly as if it were alone.

The boundaries come as `cu_seqlens` (the flash-attn / fla varlen convention): int `[n_docs + 1]`, 0 ... T, strictly
increasing; document d is tokens `cu_seqlens[d] : cu_seqlens[d + 1]`. Inside megatron modules they travel as
megatron's `PackedSeqParams(qkv_format="thd", cu_seqlens_q=..., cu_seqlens_kv=...)` (the `packed_seq_params`
argument `TransformerBlock` hands every layer), so a stock `GPTModel` passes them too.

Only the sequence mixers (KDA, MLA with its DSA indexer) see documents (`accepts_documents`); everything else works
per token. Both take them as tensor code over the whole row with each token's document and position (`ids`,
`positions`), whose shapes do not depend on the packing, so a compiled layer is one graph for every packing: KDA's
short conv window and its recurrence restart at each boundary (fla's varlen kernel with `cu_seqlens` on CUDA); the
DSA indexer's k-pools start at each document's first token and are candidates only for its queries, so selections
(row positions) stay inside the document and a `shared` layer reuses them. Both are exact (KDA's tensor code up to
fp32 rounding: its chunks are the row's, not the document's; the indexer up to the order of exactly tied scores,
docs/usage.md), also when sequence parallelism splits a document over ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def check_cu_seqlens_type(cu_seqlens: object) -> None:
    """A ValueError unless `cu_seqlens` is a 1-D integer tensor (its values are checked by `Documents`)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [n_docs + 1], got "
            f"{type(cu_seqlens).__name__} {tuple(getattr(cu_seqlens, 'shape', ()))}"
        )


@dataclass(frozen=True)
class Documents:
    """Validated document boundaries of a packed row of `length` tokens: as host ints (`bounds`, for the modules
    that loop over documents) and as tensors whose shapes do not depend on the documents (`ids`, `positions`), for
    tensor code that a compiled layer traces once for every packing of a row (KDA)."""

    bounds: tuple[tuple[int, int], ...]  # (start, end) per document, host ints
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1], on the row's device
    ids: torch.Tensor  # int64 [T] on the row's device: each token's document
    positions: torch.Tensor  # int64 [T] on the row's device: each token's position inside its document

    @property
    def length(self) -> int:
        return self.bounds[-1][1]

    @functools.cached_property
    def cu_seqlens_host(self) -> torch.Tensor:
        """int64 [n_docs + 1] on the CPU, from the host boundaries (fla builds its chunk indices from it)."""
        return torch.tensor([0] + [end for _, end in self.bounds])

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, length: int, batch: int = 1, host_cuts: list[int] | None = None
    ) -> Documents:
        """Check `cu_seqlens` against a row of `length` tokens (batch must be 1); one host read of `n_docs + 1`
        integers, or none when the caller read them already (`host_cuts`)."""
        check_cu_seqlens_type(cu_seqlens)
        if batch != 1:
            raise ValueError(f"cu_seqlens packs documents into one row: input batch must be 1, got {batch}")
        cuts = [int(c) for c in (cu_seqlens.tolist() if host_cuts is None else host_cuts)]
        if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != length:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the row length {length}, got {cuts[:3]}...{cuts[-2:]}"
            )
        if any(b <= a for a, b in zip(cuts[:-1], cuts[1:], strict=True)):
            raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got {cuts}")
        # each token's document and position, computed where the row is (no host data sent, nothing read back)
        cu = cu_seqlens.to(torch.long)
        tokens = torch.arange(length, device=cu.device)
        ids = torch.searchsorted(cu, tokens, right=True) - 1  # [T]
        return cls(
            tuple(zip(cuts[:-1], cuts[1:], strict=True)), cu_seqlens.to(torch.int32), ids, tokens - cu[ids]
        )

    @classmethod
    def from_packed_seq_params(cls, params: PackedSeqParams, length: int, batch: int = 1) -> Documents:
        """The documents of megatron's packed-sequence parameters, validated once and kept on the object (every
        layer reads them; the host read happens once per forward)."""
        cached = getattr(params, "_glm53_documents", None)
        # the length from a shape, not from `bounds`: a compiled layer would guard on every boundary it read
        if isinstance(cached, Documents) and cached.ids.shape[0] == length and batch == 1:
            return cached
        q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if q is None or (kv is not None and kv is not q and not torch.equal(q, kv)):
            raise ValueError(
                "packed_seq_params: GLM-5.3 needs cu_seqlens_q (self-attention: cu_seqlens_kv equal)"
            )
        if params.cu_seqlens_q_padded is not None and not torch.equal(params.cu_seqlens_q_padded, q):
            raise ValueError("packed_seq_params: padded cu_seqlens (cu_seqlens_q_padded) are not supported")
        documents = cls.from_cu_seqlens(q, length, batch)
        params._glm53_documents = documents
        return documents

    def packed_seq_params(self) -> PackedSeqParams:
        longest = max(end - start for start, end in self.bounds)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=longest, max_seqlen_kv=longest,
        )  # fmt: skip
        params._glm53_documents = self
        return params

    def same_document(self, shift: int, device: torch.device) -> torch.Tensor:
        """bool [T]: position t and t + shift lie in the same document. Positions past the row's end count as the
        last document (a training window's `next_tokens` continue the row's last document)."""
        ids = self.ids.to(device)
        doc = torch.cat([ids, ids.new_full((shift,), len(self.bounds) - 1)])
        return doc[: self.length] == doc[shift:]
