"""Model converters: what changes a built model before the engine wraps it, chosen once from the run's options
(torchtitan's model converters). The trainer, the planner and the dry run apply the same list in order
(`apply_converters`) and ask it, not the options, what it added:

- `LoraAdapters`: LoRA adapters on the `--lora-targets` (layers/lora_targets.py), the same initial ones on every
  rank and at every layout. The parameters it adds (`adds`) are all that a checkpoint over a recorded base holds
  (an adapter checkpoint); its `record` is what that checkpoint keeps, and a resume takes only the same adapters.
- `TrainableSelection`: which parameters train (training/trainable.py): with adapters only theirs, then
  `--trainable` / `--freeze`; the DSA indexer only under its own loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from ..layers.lora import LoraSpec, is_lora_param
from ..layers.lora_targets import apply_lora
from .trainable import select_trainable


class ModelConverter(Protocol):
    def convert(self, model: nn.Module, etp_group: Any = None) -> str | None:
        """Change `model` in place; a line for the run's log, or None."""
        ...


@dataclass(frozen=True)
class LoraAdapters:
    spec: LoraSpec

    def convert(self, model: nn.Module, etp_group: Any = None) -> str | None:
        apply_lora(
            model, self.spec, etp_group=etp_group
        )  # an ETP group: each rank's slice of an expert adapter
        return None

    @staticmethod
    def adds(name: str) -> bool:
        """A parameter these adapters add to the model."""
        return is_lora_param(name)

    @property
    def record(self) -> dict[str, Any]:
        """What a checkpoint records of them (rank, alpha, dropout, targets)."""
        return self.spec.record()

    @staticmethod
    def describe(record: dict[str, Any] | None) -> str:
        if record is None:
            return "no LoRA adapters"
        return (f"rank {record['rank']}, alpha {record['alpha']:g}, dropout {record['dropout']:g}, targets "
                f"{','.join(record['targets'])}")  # fmt: skip


@dataclass(frozen=True)
class TrainableSelection:
    adapters: bool  # with adapters: only theirs train, unless --trainable says more
    trainable: str | None = None
    freeze: str | None = None
    train_indexer: bool = False

    def convert(self, model: nn.Module, etp_group: Any = None) -> str | None:
        return select_trainable(model, self.adapters, self.trainable, self.freeze, self.train_indexer)


def model_converters(
    lora: LoraSpec | None,
    trainable: str | None = None,
    freeze: str | None = None,
    train_indexer: bool = False,
) -> list[ModelConverter]:
    """The converters of a run, in the order they apply."""
    converters: list[ModelConverter] = [] if lora is None else [LoraAdapters(lora)]
    if (
        lora is not None or trainable or freeze
    ):  # otherwise everything trains (the indexer: transformer_config)
        converters.append(TrainableSelection(lora is not None, trainable, freeze, train_indexer))
    return converters


def apply_converters(model: nn.Module, converters: list[ModelConverter], etp_group: Any = None) -> list[str]:
    """Apply them in order; the lines they say."""
    said = [converter.convert(model, etp_group) for converter in converters]
    return [line for line in said if line]


def adapters_of(converters: list[ModelConverter]) -> LoraAdapters | None:
    """The converter adding adapters over a frozen base, if any (what adapter checkpoints are about)."""
    return next((c for c in converters if isinstance(c, LoraAdapters)), None)
