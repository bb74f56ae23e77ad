"""Several data sources mixed by weight: `--data a.jsonl:3 b.txt:1`.

Each source is read as it would be alone (its own shape: chat, text, indexed dataset; its own tokenization and
packing cache and its own seeded order, re-shuffled each of its epochs); the mixture only decides which source a
run position reads, and the how-many-th sample of that source it is. A weight is a share: `a:3 b:1` gives a 75% of
the samples and b 25%, whatever their sizes (a small source is read several times, a large one partly, in each
epoch of the mixture).

The schedule is deterministic and periodic, as megatron's blended datasets are, so a resumed run (and any world
size, EP or ETP) reads exactly the samples of the uninterrupted run: the weights' exact fractions fix a block of B
positions (B the least common denominator of the shares, at most `MAX_BLOCK`, past which the shares are rounded
to 1/B by largest remainders) in which source k has c_k = share_k·B positions, spread evenly (its j-th at (j + ½)/c_k
of the block); run position i is block i // B, and source k's sample `block·c_k + j`.

One epoch of a mixture is as many samples as its sources hold together (the run's step count under
`--train-epochs`); the start-up line says how many times each source is read in it. When any source is chat data
or `--pack` is given, every source is packed (a micro-batch is one shape); otherwise every source gives windows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .packing import Batch, SeededOrder, hold_out, packed_batch, window_batch

MAX_BLOCK = 1 << 20  # positions per period of the schedule: 1M (6 MB of arrays) before the shares are rounded


@dataclass(frozen=True)
class DataSource:
    """One `--data` entry: a path (file or indexed-dataset prefix) and its weight (as given: its exact value)."""

    path: str
    weight: str | None  # None: no weight given (one source alone, or an equal share)
    entry: str  # as written on the command line, for messages

    @property
    def share(self) -> Fraction:
        return Fraction(self.weight) if self.weight is not None else Fraction(1)


def _names_data(path: str) -> bool:
    """A data file, or an indexed dataset's prefix (its .bin / .idx beside it), exists at `path`."""
    return os.path.exists(path) or os.path.exists(path + ".idx") or os.path.exists(path + ".bin")


def parse_sources(entries: Sequence[str], option: str = "--data") -> list[DataSource]:
    """`PATH[:WEIGHT]` entries: the text after the last ':' is a weight when it reads as a number (a path may hold
    ':' otherwise), unless the whole entry names existing data and the part before ':' does not
    (`corpus-2024-01-01T10:30` is a file; weigh it as `corpus-2024-01-01T10:30:2`); where both exist the entry is
    refused as ambiguous. A ValueError names the entry: a weight that is not > 0 and finite, a source given twice,
    weights on some entries but not others."""
    sources = []
    for entry in entries:
        path, weight = entry, None
        head, sep, tail = entry.rpartition(":")
        if sep and head:
            try:
                value = float(tail)
            except ValueError:
                value = None
            if value is not None and _names_data(entry):
                if _names_data(head):
                    raise ValueError(f"{option} {entry!r}: both {entry!r} and {head!r} exist, so ':{tail}' may be a "
                                     f"weight or part of the name; write {entry}:1 for the first, or rename one")  # fmt: skip
                value = None  # the whole entry is the file's name
            if value is not None:
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"{option} {entry!r}: the weight after ':' must be a finite number > 0")
                path, weight = head, tail
        sources.append(DataSource(path, weight, entry))
    paths = [os.path.realpath(s.path) for s in sources]
    for i, p in enumerate(paths):
        if p in paths[:i]:
            raise ValueError(f"{option} {sources[i].entry!r}: this source is given twice (weigh it once)")
    weighed = [s.weight is not None for s in sources]
    if len(sources) > 1 and any(weighed) and not all(weighed):
        unweighed = next(s.entry for s in sources if s.weight is None)
        raise ValueError(
            f"{option} {unweighed!r}: give every source a weight (PATH:WEIGHT) or none (equal shares)"
        )
    return sources


def block_schedule(
    shares: Sequence[Fraction], max_block: int = MAX_BLOCK
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(source of each block position [B] int16, its index among that source's positions [B] int32, positions per
    source c_k) for shares summing to anything > 0."""
    total = sum(shares, Fraction(0))
    fractions = [s / total for s in shares]
    block = math.lcm(*(f.denominator for f in fractions))
    if block <= max_block:
        counts = [int(f * block) for f in fractions]
    else:  # each share rounded on its own (equal shares, equal counts), every source at least one position:
        # c_k = max(1, round(f_k (max_block - n))) <= f_k (max_block - n) + 1, so the block stays <= max_block
        room = max_block - len(fractions)
        counts = [max(1, round(f * room)) for f in fractions]
        block = sum(counts)
    source = np.concatenate([np.full(c, k, dtype=np.int16) for k, c in enumerate(counts)])
    index = np.concatenate([np.arange(c, dtype=np.int32) for c in counts])
    when = np.concatenate([(np.arange(c) + 0.5) / c for c in counts])
    order = np.lexsort((source, when))  # by place in the block, ties by source
    return source[order], index[order], counts


class MixedStream:
    """Sources read by a weighted periodic schedule (module docstring); the same interface as one stream."""

    def __init__(self, sources: Sequence[DataSource], streams: Sequence[Any]) -> None:
        self.sources, self.streams = list(sources), list(streams)
        self.packed = bool(self.streams[0].packed)  # every source is, or none (training/data.py, open_stream)
        self.seq_length = self.streams[0].seq_length
        self.notices = [n for s in self.streams for n in s.notices]
        self.reschedule([s.share for s in self.sources])

    def reschedule(self, shares: Sequence[Fraction]) -> None:
        self.shares = list(shares)
        self._source, self._index, self.counts = block_schedule(self.shares)
        self.num_samples = sum(
            s.num_samples for s in self.streams
        )  # one epoch: what the sources hold together

    def locate(self, position: int) -> tuple[int, int]:
        """(source, that source's run position) read at run position `position`."""
        block, offset = divmod(position, len(self._source))
        k = int(self._source[offset])
        return k, block * self.counts[k] + int(self._index[offset])

    @property
    def identity(self) -> dict[str, object]:
        """Each source's identity with its weight, in order: a resume with other sources, weights or order is
        refused like a resume over other data."""
        total = sum(self.shares, Fraction(0))  # normalised: a:6 b:2 is a:3 b:1
        return {"mixture": [{"data": s.entry, "weight": str(share / total), **stream.identity}
                            for s, share, stream in zip(self.sources, self.shares, self.streams, strict=True)]}  # fmt: skip

    def passes_per_epoch(self) -> list[float]:
        """How many times each source is read in one epoch of the mixture."""
        total = sum(self.shares, Fraction(0))
        return [float(self.num_samples * share / total) / s.num_samples for share, s in zip(self.shares, self.streams, strict=True)]  # fmt: skip

    def describe(self) -> str:
        total = sum(self.shares, Fraction(0))
        parts = [f"{s.entry} {100 * float(share / total):.3g}% ({stream.num_samples} samples, read {passes:.3g}x)"
                 for s, share, stream, passes in zip(self.sources, self.shares, self.streams, self.passes_per_epoch(),
                                                     strict=True)]  # fmt: skip
        return f"data: a mixture of {len(self.sources)} sources; per epoch: " + "; ".join(parts)

    def micro_batch(self, consumed: int, micro: int, rank: int, world: int, micro_batch: int) -> Batch:
        located = [self.locate(p) for p in SeededOrder.positions(consumed, micro, rank, world, micro_batch)]
        if self.packed:
            return packed_batch([self.streams[k].row(i) for k, i in located], self.seq_length)
        return window_batch([self.streams[k].sample(i) for k, i in located])


def split_validation(train: Any, valid: Any, fraction: float) -> int:
    """`--valid-split`: the last `fraction` of the samples to `valid`, the rest to `train` (two streams over the
    same data; `packing.hold_out`). Of a mixture, of each source: validation reads every held-out sample once per
    pass (shares by size), training keeps the weights. Returns how many were held out."""
    if not isinstance(train, MixedStream):
        return hold_out(train, valid, fraction)
    held = sum(hold_out(t, v, fraction) for t, v in zip(train.streams, valid.streams, strict=True))
    train.reschedule(train.shares)
    valid.reschedule([Fraction(s.num_samples) for s in valid.streams])
    return held
