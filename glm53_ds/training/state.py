"""`TrainingState`: what a training checkpoint records of the run beside its tensors, typed.

On disk it stays `client_state.pt` (checkpoint/directory.py: a dict of plain values and one RNG tensor, read with
`weights_only=True` after the manifest check): `client_state()` writes that dict, `from_client_state` reads it,
checkpoints written before a field existed included (the field is then absent from `recorded`, and each reader says
what it assumes). A run reads its --load checkpoint's state once (`resume.ResumeChecks.saved_state`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.directory import latest_tag, tag_step
from ..engine import read_client_state
from ..safe_io import published_tags, remove_dir

FIELDS = ("step", "consumed_samples", "global_batch_size", "data", "rng", "schedule", "lora", "base", "run")


@dataclass
class TrainingState:
    step: int = 0  # optimizer steps taken
    consumed_samples: int = 0  # the data position: samples (rows) read by all ranks
    global_batch_size: int | None = None  # sequences per step over all ranks
    data: dict[str, Any] = field(
        default_factory=dict
    )  # the stream's identity: corpus, length, seed, sample range
    rng: torch.Tensor | None = None  # torch's CPU RNG state
    schedule: dict[str, Any] | None = (
        None  # what fixes the learning rate at each step (resume.schedule_record)
    )
    lora: dict[str, Any] | None = None  # the adapters (LoraSpec.record), None without
    base: dict[str, Any] | None = (
        None  # a LoRA run's base weights and their checksums (checkpoint/base_weights.py)
    )
    run: str | None = (
        None  # the run's id (training/output_dir.py): made at a fresh start, kept by its resumes
    )
    recorded: frozenset[str] = frozenset(FIELDS)  # the fields the checkpoint holds (older ones lack some)

    @classmethod
    def from_client_state(cls, client: dict[str, Any]) -> TrainingState:
        present = {k: client[k] for k in FIELDS if k in client}
        state = cls(recorded=frozenset(present), **present)
        state.step, state.consumed_samples = int(state.step), int(state.consumed_samples)
        return state

    @classmethod
    def read(cls, load_dir: str, tag: str) -> TrainingState:
        """The state of checkpoint `load_dir`/`tag` (manifest-checked); an empty one, nothing recorded, for a
        converted (model-only) checkpoint."""
        return cls.from_client_state(read_client_state(load_dir, tag))

    def client_state(self) -> dict[str, Any]:
        """The dict `client_state.pt` holds."""
        return {k: getattr(self, k) for k in FIELDS}

    def saved_global_batch(self) -> int | None:
        """The global batch it trained with; before it was recorded, consumed samples / steps where that divides."""
        if self.global_batch_size:
            return int(self.global_batch_size)
        step, consumed = self.step, self.consumed_samples
        return consumed // step if step and consumed % step == 0 else None


def prune_checkpoints(save_dir: str, keep: int, run: str) -> list[str]:
    """`--keep-last keep`: remove run `run`'s tags of `save_dir` but its newest `keep` (by step), never the one
    `latest` names and never a tag another run (or a run before run ids) wrote, as each records
    (`TrainingState.run`). Call once a newer checkpoint is whole. Returns the tags removed."""
    pointed = latest_tag(save_dir)
    ours = []
    for tag in published_tags(save_dir):
        step = tag_step(tag)
        if step is not None and tag != pointed:
            try:
                recorded = TrainingState.read(save_dir, tag).run
            except (OSError, ValueError):  # not readable as ours: left alone
                continue
            if recorded == run:
                ours.append((step, tag))
    newest = tag_step(pointed)
    kept = keep - (1 if newest is not None else 0)  # the one latest names counts among the kept
    removed = [tag for _, tag in sorted(ours)[: max(len(ours) - max(kept, 0), 0)]]
    for tag in removed:
        remove_dir(os.path.join(save_dir, tag))
    return removed
