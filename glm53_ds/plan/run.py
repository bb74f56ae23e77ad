"""The run the planner counts: `PlannedRun`, the trainer's own options (a `TrainConfig`) with the ZeRO stage and
dtype of its DeepSpeed config and the model they name.

The planner's flags are the options training/config.py marks as changing one rank's memory (`plan=MEMORY` or
`SEARCHED`), generated from their declarations (`planner_options`); its flags or a trainer's run file become one
`TrainConfig` (`planned_config`), and that object, not lists of its values, is what the counts (counts.py), the
activation trace (activations.py, dry_run.py), the training state and memory (memory.py), the hints and the search
read. `--search`'s layouts and the hints are variants of it (`PlannedRun.variant`: other values of its options).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from ..config import Glm53Config
from ..layers.block_fp8 import KINDS, RELEASED_BLOCK
from ..training.base_quant import resolve_base_quant
from ..training.config import TrainConfig
from ..training.errors import SetupError
from ..training.model_converters import ModelConverter, model_converters
from ..training.options import add_options, planned, say_defaults
from ..training.run_file import read_config
from ..training.run_plan import default_deepspeed_config, model_config, zero_stage_and_bf16
from ..training.trainable import indexer_loss_trainable

# the trainer's default chunk of the loss head's fp32 logits (a run's flags name another one)
LOSS_CHUNK_MIB: int = TrainConfig.loss_chunk_mib
# The planner's defaults where they differ from the trainer's (whose defaults are the tiny CPU job's): the released
# model's usual run. A run file is planned with the trainer's defaults, as the trainer would run it.
PLANNER_DEFAULTS: dict[str, Any] = dict(model_config="glm-5.3-flash", seq_length=8192, micro_batch_size=1)
PLANNER_ZERO = 1  # ZeRO stage of a run given by flags without --zero or --deepspeed_config

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """'141GB', '80GiB', '141e9', '2TB' -> bytes (a ValueError naming `option`)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{option} {text!r}: expected a size such as 141GB or 80GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class PlannedRun:
    """One run as the planner counts it (see the module docstring). `config.gpus` is the world."""

    config: TrainConfig
    zero: int  # ZeRO stage
    bf16: bool  # the training dtype: bf16, else fp32
    model: Glm53Config  # the model the options name, the run's MTP choice applied

    @classmethod
    def of(cls, config: TrainConfig, zero: int | None = None, bf16: bool | None = None) -> PlannedRun:
        """The run of `config`: its model (`--hf-dir`, `--model-config`, `--load`'s record), ZeRO stage and dtype
        from its --deepspeed_config (else the trainer's GPU default), unless `zero` / `bf16` are given."""
        ds = default_deepspeed_config(on_gpu=True)  # the trainer's, on the GPUs the run is planned for
        if config.deepspeed_config:
            try:
                with open(config.deepspeed_config, encoding="utf-8") as f:
                    ds = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--deepspeed_config {config.deepspeed_config!r}: {e}") from e
        file_zero, file_bf16 = zero_stage_and_bf16(ds)
        if config.load and not (config.hf_dir or config.model_config):
            raise ValueError(f"the model is --load {config.load}'s: give --model-config (a run file: [model] "
                             "model_config) for the planner")  # fmt: skip
        return cls(config, file_zero if zero is None else zero, file_bf16 if bf16 is None else bf16,
                   model_config(config))  # fmt: skip

    @classmethod
    def for_model(
        cls, model: Glm53Config, zero: int = PLANNER_ZERO, bf16: bool = True, **options: Any
    ) -> PlannedRun:
        """A run of `model` (a config in hand: tests, benchmarks) with these options, the trainer's defaults for
        the rest (`no_mtp` drops the model's MTP layer)."""
        config = TrainConfig(**options)
        if config.no_mtp:
            model = model.replace(num_nextn_predict_layers=0)
        return cls(config, zero, bf16, model)

    def variant(
        self, zero: int | None = None, model: Glm53Config | None = None, **options: Any
    ) -> PlannedRun:
        """The same run with other values of some options (`--search`'s layouts, the hints), another ZeRO stage or
        another model (the activation trace's reduced one)."""
        return PlannedRun(dataclasses.replace(self.config, **options), self.zero if zero is None else zero,
                          self.bf16, self.model if model is None else model)  # fmt: skip

    # ---- what the options decide, read by the counts, the trace and the memory
    @property
    def world(self) -> int:
        if self.config.gpus is None:
            raise ValueError("--world is required (or --search for the smallest layouts that fit)")
        return self.config.gpus

    @property
    def gpu(self) -> int:
        """One GPU's memory in bytes (--gpu-memory)."""
        return parse_bytes(self.config.gpu_memory)

    @property
    def lora_rank(self) -> int:
        return self.config.lora_rank

    @property
    def trains_indexer(self) -> bool:
        return self.config.indexer_loss_coef > 0

    @property
    def trainable(self) -> str | None:
        """--trainable as given; without it, what a run of this indexer loss needs (a LoRA run names the indexer,
        as the trainer asks; its flags say so)."""
        if self.config.trainable is not None:
            return self.config.trainable
        return indexer_loss_trainable(self.lora_rank > 0, self.trains_indexer)

    @functools.cached_property
    def base_fields(self) -> dict[str, Any]:
        """The transformer-config fields of the base the run keeps in block-FP8 (--base-quant): what the trainer
        resolves from --hf-dir when it is given; without weights, `fp8` means the release's format (routed, shared
        and dense MLP experts at 128 x 128) and `auto` a dense base (no FP8 checkpoint named)."""
        c = self.config
        if c.hf_dir:
            try:
                quant = resolve_base_quant(c, self.model, c.hf_dir, self.model.num_nextn_predict_layers > 0)
            except SetupError as e:
                raise ValueError(str(e).removeprefix("error: ")) from e
            return quant.transformer_fields()
        if c.base_quant != "fp8":
            return {}
        if c.lora_rank == 0:
            raise ValueError("--base-quant fp8: the block-FP8 weights stay frozen, and full fine-tuning trains every "
                             "weight; use --base-quant none")  # fmt: skip
        return dict(block_fp8_modules=KINDS, block_fp8_block=RELEASED_BLOCK)

    def converters(self) -> list[ModelConverter]:
        """The trainer's model converters for this run: its LoRA adapters and trainable set."""
        return model_converters(
            self.config.lora_spec(), self.trainable, self.config.freeze, self.trains_indexer
        )

    # ---- the run in the trainer's words
    def __str__(self) -> str:
        c = self.config
        return (f"world {c.gpus}: EP {c.ep} x ETP {c.etp} x SP {c.sp}, ZeRO {self.zero}, "
                f"recompute {c.recompute}{', activations offloaded' if c.offload_activations else ''}"
                f"{f', MoE tiles of {c.moe_tile_mib} MiB' if c.moe_tile_mib else ''}"
                f"{'' if c.loss_chunk_mib == LOSS_CHUNK_MIB else f', {self._loss_head()}'}"
                f"{', base in block-FP8' if self.base_fields else ''}")  # fmt: skip

    def _loss_head(self) -> str:
        chunk = self.config.loss_chunk_mib
        return f"loss chunks of {chunk} MiB" if chunk > 0 else "materialised logits"

    def layout_dict(self) -> dict[str, Any]:
        """The layout's values (JSON: each plan's `layout`)."""
        c = self.config
        return dict(world=c.gpus, ep=c.ep, etp=c.etp, sp=c.sp, zero=self.zero, recompute=c.recompute,
                    offload_activations=c.offload_activations, moe_tile_mib=c.moe_tile_mib,
                    loss_chunk_mib=c.loss_chunk_mib)  # fmt: skip

    def deepspeed_config_path(self) -> str:
        """The shipped DeepSpeed config of this ZeRO stage and dtype (ds_configs/)."""
        if self.bf16 and self.zero in (1, 2):
            return f"ds_configs/zero{self.zero}_bf16.json"
        return (
            "ds_configs/cpu.json"
            if self.zero == 0 and not self.bf16
            else f"<a ZeRO-{self.zero} {'bf16' if self.bf16 else 'fp32'} config>"
        )

    def trainer_flags(self) -> str:
        """The layout as `deepspeed launch/train.py` takes it (world: the launcher's GPUs)."""
        c = self.config
        return (f"--ep {c.ep} --etp {c.etp} --sp {c.sp} --recompute {c.recompute} "
                f"{'--offload-activations ' if c.offload_activations else ''}"
                f"{f'--moe-tile-mib {c.moe_tile_mib} ' if c.moe_tile_mib else ''}"
                f"{'' if c.loss_chunk_mib == LOSS_CHUNK_MIB else f'--loss-chunk-mib {c.loss_chunk_mib} '}"
                f"--deepspeed_config {self.deepspeed_config_path()}"
                f"{' --offload-optimizer cpu' if c.offload_optimizer == 'cpu' else ''}")  # fmt: skip

    def run_flags(self) -> str:
        """The run's flags beside the layout's that change what it holds: the indexer loss (it trains the indexer;
        a LoRA run names it trainable too, as the trainer asks)."""
        c = self.config
        base = " --base-quant fp8" if self.base_fields else ""
        if c.indexer_loss_coef <= 0:
            return base
        trainable = self.trainable
        return (
            base
            + f" --indexer-loss-coef {c.indexer_loss_coef}"
            + (f" --trainable '{trainable}'" if trainable else "")
        )


def planner_options(parser: argparse.ArgumentParser) -> None:
    """The planner's flags: the trainer's options that change one rank's memory, as declared (their defaults left
    out: `planned_config` applies the trainer's or the planner's), and --world for --gpus."""
    add_options(parser, TrainConfig, names=planned(TrainConfig))
    parser.add_argument("--world", dest="gpus", type=int, help="ranks (GPUs), as --gpus; required without "
                        "--search; with it, the one world to search (default: 8 to 1024)")  # fmt: skip
    say_defaults(parser, {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, **PLANNER_DEFAULTS})


def planned_config(
    given: dict[str, Any], run_file: str | None, trainer_parser: argparse.ArgumentParser
) -> TrainConfig:
    """The run's `TrainConfig` from the planner's flags `given` (those given only) over a run file's options: the
    trainer's defaults under a run file (the run as the trainer would make it), else the planner's."""
    values: dict[str, Any] = {}
    if run_file is not None:
        file_argv, _ = read_config(run_file, trainer_parser)
        parsed = vars(trainer_parser.parse_args(file_argv))  # options not given are absent (argument_default)
        values = {f.name: parsed[f.name] for f in dataclasses.fields(TrainConfig) if f.name in parsed}
    elif not (given.get("hf_dir") or given.get("load")):
        values = dict(PLANNER_DEFAULTS)
    else:
        values = {k: v for k, v in PLANNER_DEFAULTS.items() if k != "model_config"}
    values.update({k: v for k, v in given.items() if k in TrainConfig.__dataclass_fields__})
    options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return TrainConfig(**options)
