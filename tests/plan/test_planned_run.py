"""The planner takes the run as one typed object (plan/run.py's `PlannedRun`: the trainer's `TrainConfig`, a ZeRO
stage, a dtype and the model): every option declared to change memory (training/config.py, `plan=MEMORY` or
`SEARCHED`) is read by the planner's counts, trace and memory, and `--search` varies only the options declared
searched. Before: the planner named its options one by one in five places, so an option could be planned at its
default without a word (`--loss-chunk-mib` once was, 15 GiB short)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from glm53_ds.plan.memory import rank_memory, search
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.config import MODEL, TrainConfig
from glm53_ds.training.options import MEMORY, option, planned, searched

# a run of the tiny model that reaches every option's reader: LoRA on (its targets and dropout are read with the
# adapters), EP 2 (a LoRA rank the grouped GEMM takes), a --trainable / --freeze pattern
RUN = dict(model_config="tiny", gpus=2, ep=2, seq_length=64, micro_batch_size=1, lora_rank=8, lora_dropout=0.1,
           trainable=r"\.router\.", freeze=r"\.mtp\.", gpu_memory="80GB")  # fmt: skip


def options_read(config: TrainConfig) -> set[str]:
    """The options of `config` the planner reads while it plans it (a run's model, counts, trace and memory;
    not its printing). Reads by `dataclasses` itself (replace copies every field) are not the planner's."""
    seen: set[str] = set()
    names = {f.name for f in dataclasses.fields(config)}

    class Recording(type(config)):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            if name in names and sys._getframe(1).f_globals.get("__name__") != "dataclasses":
                seen.add(name)
            return super().__getattribute__(name)

    Recording.__name__ = type(config).__name__
    recording = Recording(**{n: object.__getattribute__(config, n) for n in names})
    seen.clear()  # construction is not the planner's
    rank_memory(PlannedRun.of(recording, zero=2))
    return seen


def unread_memory_options(config: TrainConfig) -> list[str]:
    return sorted(set(planned(type(config))) - options_read(config))


@dataclass(frozen=True)
class WithANewOption(TrainConfig):
    """A new option declared to change memory that the planner knows nothing of (the control)."""

    new_knob: int = option(0, MODEL, "a new option that changes memory", plan=MEMORY)


def test_every_option_declared_to_change_memory_is_read_by_the_planner():
    assert unread_memory_options(TrainConfig(**RUN)) == []
    # control: a newly declared memory option the planner ignores is caught by name
    assert unread_memory_options(WithANewOption(**RUN)) == ["new_knob"]


def test_the_search_varies_only_the_options_declared_searched():
    """`--search` keeps every other option of the run (here LoRA, its targets, the length, the loss chunk, MoE
    tiles: the search ignored the tiles before) and varies the declared ones (it finds EP 2 at world 2)."""
    run = PlannedRun.for_model(PlannedRun.of(TrainConfig(model_config="tiny")).model, seq_length=128,
                               micro_batch_size=1, lora_rank=8, lora_targets="mla,experts", loss_chunk_mib=64,
                               moe_tile_mib=1, gpu_memory="10GB")  # fmt: skip
    found = search(run, worlds=(2,))
    assert found.world == 2 and found.fitting
    allowed = set(searched(TrainConfig))
    assert allowed == {"gpus", "ep", "etp", "sp", "recompute", "offload_activations"}
    varied: set[str] = set()
    for memory in found.fitting:
        changed = {f.name for f in dataclasses.fields(TrainConfig)
                   if getattr(memory.run.config, f.name) != getattr(run.config, f.name)}  # fmt: skip
        assert changed <= allowed, changed
        varied |= changed
    assert {"gpus", "ep"} <= varied and any(m.run.config.ep == 2 for m in found.fitting)
