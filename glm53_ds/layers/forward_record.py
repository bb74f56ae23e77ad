"""What a forward produces besides activations, handed out as values: `ForwardRecord`, opened by the caller.

Layers deep inside megatron's block cannot return extra values (a layer returns its hidden states and a context).
`Glm53Model.forward` therefore opens a record (`recording()`) around its decoder and MTP; while it is open a layer
adds what it computed: the MoE's sequence-wise balance loss, a trained DSA indexer's KL loss, the tokens per
expert. Outside a record (a stock megatron `GPTModel` built from the specs, a layer called alone)
nothing is kept. Nothing is left on the modules between forwards, and nothing is found by scanning them.

The record lives in a `ContextVar`: a recompute in backward (activation checkpointing) runs after the forward has
closed its record and adds nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardRecord:
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # MoE balance losses (already weighted)
    indexer_losses: list[torch.Tensor] = field(default_factory=list)  # per trained DSA indexer: its KL loss
    expert_loads: list[torch.Tensor] = field(
        default_factory=list
    )  # per MoE layer: int64 [E] tokens per expert

    def aux_loss(self) -> torch.Tensor | None:
        return torch.stack(self.aux_losses).sum() if self.aux_losses else None

    def indexer_loss(self) -> torch.Tensor | None:
        """Sum over layers of each layer's KL(attention || indexer) mean over its queries."""
        return torch.stack(self.indexer_losses).sum() if self.indexer_losses else None


_CURRENT: ContextVar[ForwardRecord | None] = ContextVar("glm53_forward_record", default=None)


@contextmanager
def recording() -> Iterator[ForwardRecord]:
    """A fresh record for the forward run inside (records do not nest: the inner one takes what is added)."""
    record = ForwardRecord()
    token = _CURRENT.set(record)
    try:
        yield record
    finally:
        _CURRENT.reset(token)


def current_record() -> ForwardRecord | None:
    """The open record, or None (nothing is being recorded)."""
    return _CURRENT.get()
