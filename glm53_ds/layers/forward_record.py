"""What a forward produces besides activations, handed out as values: `ForwardRecord`, opened by the caller.

Layers deep inside megatron's block cannot return extra values (a layer returns its hidden states and a context).
`Glm53Model.forward` therefore opens a record (`recording()`) around its decoder and MTP; while it is open a layer
adds what it computed: the MoE's sequence-wise balance loss, a trained DSA indexer's KL loss, the tokens per
expert. Outside a record (a stock megatron `GPTModel` built from the specs, a layer called alone)
nothing is kept. Nothing is left on the modules between forwards, and nothing is found by scanning them.

The open records are a module-level stack, innermost last: a recompute in backward (activation checkpointing) runs
after the forward has closed its record and adds nothing twice. Not a `ContextVar`, which torch.compile cannot
read; a compiled region (glm53_ds/compile.py) runs inside a record of its own (`region_record`), empty at every
call, so that its guards do not depend on how many layers added to the forward's record before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch


@dataclass
class ForwardRecord:
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # MoE balance losses (already weighted)
    indexer_losses: list[torch.Tensor] = field(default_factory=list)  # per trained DSA indexer: its KL loss
    expert_loads: list[torch.Tensor] = field(
        default_factory=list
    )  # per MoE layer: int64 [E] tokens per expert

    def extend(self, other: ForwardRecord) -> None:
        """Append everything `other` holds, field by field."""
        for f in fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))

    def aux_loss(self) -> torch.Tensor | None:
        return torch.stack(self.aux_losses).sum() if self.aux_losses else None

    def indexer_loss(self) -> torch.Tensor | None:
        """Sum over layers of each layer's KL(attention || indexer) mean over its queries."""
        return torch.stack(self.indexer_losses).sum() if self.indexer_losses else None


_OPEN: list[ForwardRecord] = []  # the open records, innermost last


@contextmanager
def recording() -> Iterator[ForwardRecord]:
    """A fresh record for the forward run inside (records do not nest: the inner one takes what is added)."""
    record = ForwardRecord()
    _OPEN.append(record)
    try:
        yield record
    finally:
        _OPEN.pop()  # context managers close innermost first


def current_record() -> ForwardRecord | None:
    """The open record, or None (nothing is being recorded)."""
    return _OPEN[-1] if _OPEN else None


@contextmanager
def region_record() -> Iterator[None]:
    """A compiled region's own record, always open and empty on entry; what the region added goes to the
    enclosing record when one is open (a recompute in backward, under none, keeps nothing)."""
    outer = current_record()
    with recording() as inner:
        yield
    if outer is not None:
        outer.extend(inner)
