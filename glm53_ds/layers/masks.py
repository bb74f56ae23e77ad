"""The one mask GLM-5.3's layers use: a key-padding mask `[b, s]` bool, True = real token (attention is causal).

KDA is a causal recurrence, so no layer can apply an arbitrary `[s, s]` mask; every accepted convention is
reduced here to the token mask:
  - `attention_mask [b, s]` (transformers' convention, `Glm53Model`): 1 / True = token;
  - `attention_mask [b or 1, 1, s, s]` bool (megatron's convention, `GPTModel`): True = masked out. It must be
    causal plus masked keys (`mask[i, j] = j > i or pad[j]`), e.g. megatron's plain causal mask; the token mask
    is read off its diagonal. Anything else (a document-block mask, a sliding window) is refused;
  - `padding_mask [b, s]` (megatron's `GPTModel(..., padding_mask=...)`): True = padding.
None everywhere means every position is a token.
"""

from __future__ import annotations

import torch


def token_mask(
    attention_mask: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    batch: int,
    seq: int,
    validate: bool = True,
) -> torch.Tensor | None:
    """The key-padding mask `[batch, seq]` bool (True = token) of the given masks, or None (all tokens).

    `validate`: check that a 4-D megatron mask is causal plus masked keys (one host sync; the first decoder
    layer validates, the others read the diagonal only)."""
    tokens = None
    if attention_mask is not None:
        tokens = _from_attention_mask(attention_mask, batch, seq, validate)
    if padding_mask is not None:
        if tuple(padding_mask.shape) != (batch, seq):
            raise ValueError(
                f"padding_mask must be [batch, seq] = ({batch}, {seq}) with True = padding, got shape "
                f"{tuple(padding_mask.shape)}"
            )
        keep = ~padding_mask.bool()
        tokens = keep if tokens is None else tokens & keep
    return tokens


def _from_attention_mask(mask: torch.Tensor, batch: int, seq: int, validate: bool) -> torch.Tensor:
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(
                f"a 2-D attention_mask is transformers' key-padding mask [batch, seq] = ({batch}, {seq}), "
                f"1 = token; got shape {tuple(mask.shape)}"
            )
        return mask.bool()
    if (
        mask.dim() != 4
        or mask.shape[1] != 1
        or tuple(mask.shape[2:]) != (seq, seq)
        or mask.shape[0] not in (1, batch)
    ):
        raise ValueError(
            f"attention_mask must be [batch, seq] (transformers, 1 = token) or megatron's [batch or 1, 1, seq, seq] "
            f"(True = masked) with batch={batch}, seq={seq}; got shape {tuple(mask.shape)}"
        )
    masked = mask[:, 0].bool()  # [b', s, s]
    tokens = ~masked.diagonal(
        dim1=-2, dim2=-1
    )  # [b', s]: a key is masked for its own query iff it is padding
    if validate:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
        expected = causal | ~tokens[:, None, :]
        if not torch.equal(masked, expected):
            raise ValueError(
                "GLM-5.3 layers take only a causal attention mask with padded keys (KDA is a causal recurrence): "
                "megatron's [b, 1, s, s] attention_mask must be True exactly where key j > query i or key j is "
                "padding. Pass padding as padding_mask [b, s] (True = padding) or a 2-D attention_mask "
                "(1 = token)"
            )
    return tokens.expand(batch, seq)
