"""A run's options resolved and checked, in the first seconds (`resolve_config`): the defaults that follow the
model, then every check that needs no process group, each problem one `SetupError` naming the option. This module
imports the declarations (training/config.py); they never import it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

from ..checkpoint.directory import has_latest, later_tags, latest_tag, not_ours
from ..data.columns import parse_column_map
from ..data.sources import resolve_source
from ..safe_io import OutputPathError, check_output_dir, published_tags
from ..transformer_config import FULL_RECOMPUTE_LOSSES
from .config import RECOMPUTE, TrainConfig, check_seq_length
from .errors import SetupError
from .mixture import parse_sources
from .model_source import REAL_WIDTH, RUN_SCALE_OPTIONS, check_model_config_file, resolve_model
from .options import check_bounds
from .packing import LONG_DOCUMENTS
from .presets import DEFAULT_ROUTER_BIAS_UPDATE_RATE, PRESET_ROUTER_BIAS_UPDATE_RATE, PRESETS
from .trainable import INDEXER_PATTERN, INDEXER_TENSORS, trains


def check_inputs(config: TrainConfig) -> None:
    """Every option but the output paths (those follow once the defaults are resolved)."""
    try:
        check_bounds(config)  # each option's declared least value (training/config.py)
    except ValueError as e:
        raise SetupError(str(e)) from e
    if config.sample_interval and not config.sample_prompts:
        raise SetupError(
            f"--sample-interval {config.sample_interval} needs --sample-prompts FILE (the prompts)"
        )
    if config.sample_prompts and config.sp > 1:
        raise SetupError(f"--sample-prompts with --sp {config.sp}: samples are not generated under sequence "
                         "parallelism (each rank holds a shard of the logits)")  # fmt: skip
    if config.train_epochs is not None and not (
        math.isfinite(config.train_epochs) and config.train_epochs > 0
    ):
        raise SetupError(f"--train-epochs must be a finite number > 0, got {config.train_epochs}")
    if config.peak_tflops is not None and not (math.isfinite(config.peak_tflops) and config.peak_tflops > 0):
        raise SetupError(f"--peak-tflops must be a finite number > 0, got {config.peak_tflops}")
    if not (math.isfinite(config.valid_split) and 0.0 <= config.valid_split <= 0.5):
        raise SetupError(f"--valid-split must be in [0, 0.5] (the fraction of --data held out), got "
                         f"{config.valid_split}")  # fmt: skip
    if config.valid_split and config.valid_data:
        raise SetupError("--valid-split with --valid-data: give one validation source")
    if config.valid_data is None and not config.valid_split:
        given = [f"--{n.replace('_', '-')}" for n in ("eval_interval", "eval_iters", "eval_at_start")
                 if getattr(config, n) != type(config).__dataclass_fields__[n].default]  # fmt: skip
        if given:
            raise SetupError(f"{', '.join(given)} without --valid-data or --valid-split: give the validation "
                             "data")  # fmt: skip
    try:
        sources = parse_sources(config.data)
    except ValueError as e:
        raise SetupError(str(e)) from e
    checked = [("--data", s.path, s.path if len(sources) == 1 else s.entry) for s in sources]
    for option, data_path, named in [*checked, ("--valid-data", config.valid_data, config.valid_data)]:
        try:
            if data_path is not None:
                resolve_source(
                    data_path, option, named
                )  # its form, in the first seconds, before DeepSpeed starts
        except (FileNotFoundError, ValueError) as e:
            raise SetupError(str(e)) from e
    try:
        parse_column_map(config.data_columns or (), [s.path for s in sources])
    except ValueError as e:
        raise SetupError(str(e)) from e
    if config.wandb_mode not in ("online", "offline"):
        raise SetupError(f"--wandb-mode must be online or offline, got {config.wandb_mode!r}")
    if config.wandb_project is None and (config.wandb_mode != "online" or config.wandb_name):
        raise SetupError("--wandb-mode / --wandb-name without --wandb-project: give the W&B project")
    if config.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise SetupError(f"--wandb-project {config.wandb_project!r}: the wandb package is not installed "
                         "(pip install \"glm53_ds[wandb]\")")  # fmt: skip
    if config.no_decay_pattern is not None:
        try:
            re.compile(config.no_decay_pattern)
        except re.error as e:
            raise SetupError(
                f"--no-decay-pattern {config.no_decay_pattern!r}: not a regular expression ({e})"
            ) from e
    for option, pattern in (("--trainable", config.trainable), ("--freeze", config.freeze)):
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise SetupError(f"{option} {pattern!r}: not a regular expression ({e})") from e
    if config.lora_rank == 0:
        given = [f"--{n.replace('_', '-')}" for n in ("lora_alpha", "lora_dropout", "lora_targets")
                 if getattr(config, n) != type(config).__dataclass_fields__[n].default]  # fmt: skip
        if given:
            raise SetupError(f"{', '.join(given)} without --lora-rank: give --lora-rank R for LoRA adapters")
    else:
        try:
            config.lora_spec()
        except ValueError as e:
            raise SetupError(f"--lora-rank / --lora-alpha / --lora-dropout / --lora-targets: {e}") from e
    if config.long_documents not in LONG_DOCUMENTS:
        raise SetupError(f"--long-documents must be one of {LONG_DOCUMENTS}, got {config.long_documents!r}")
    if config.recompute not in RECOMPUTE:
        raise SetupError(f"--recompute must be one of {RECOMPUTE}, got {config.recompute!r}")
    if config.moe_tile_mib and config.aux_loss_coef > 0:
        raise SetupError(f"--moe-tile-mib {config.moe_tile_mib} with --aux-loss-coef {config.aux_loss_coef}: the "
                         "sequence-wise balance loss needs the whole sequence's routing at once; set one to 0")  # fmt: skip
    check_offload(config.offload_activations, config.recompute)
    check_recompute_losses(config.recompute, config.aux_loss_coef, config.indexer_loss_coef)
    check_indexer_loss_trains(config)
    if config.hf_dir and not os.path.isfile(os.path.join(config.hf_dir, "config.json")):
        raise SetupError(f"--hf-dir {config.hf_dir!r}: no config.json there")
    if config.model_config and config.model_config not in PRESETS and not os.path.isfile(config.model_config):
        raise SetupError(
            f"--model-config {config.model_config!r}: not a file and not a preset {sorted(PRESETS)}"
        )
    for option, path in (("--hf-dir", config.hf_dir and os.path.join(config.hf_dir, "config.json")),
                         ("--model-config", not config.hf_dir and config.model_config not in PRESETS and config.model_config)):  # fmt: skip
        if path:
            check_model_config_file(option, path)
    if config.load:
        if config.load_tag:
            if not os.path.isdir(os.path.join(config.load, config.load_tag)):
                raise SetupError(
                    f"--load {config.load!r}: no checkpoint there (tag {config.load_tag!r} is missing)"
                )
        elif not has_latest(config.load):
            raise SetupError(f"--load {config.load!r}: no checkpoint there (the file 'latest' is missing)")
    if config.deepspeed_config and not os.path.isfile(config.deepspeed_config):
        raise SetupError(f"--deepspeed_config {config.deepspeed_config!r}: no such file")


def check_adapter_export(config: TrainConfig) -> None:
    """--export-adapter writes the adapters alone: refused before any work where the run changes anything else
    (a PEFT adapter would drop it silently)."""
    if not config.export_adapter:
        return
    if not config.lora_rank:
        raise SetupError("--export-adapter without --lora-rank: only a LoRA run has adapters to export (use "
                         "--export-hf for the model)")  # fmt: skip
    if config.trainable:
        raise SetupError(f"--export-adapter with --trainable {config.trainable!r}: the run trains tensors besides "
                         "the adapters, which a PEFT adapter cannot carry; export the merged model "
                         "(--export-hf)")  # fmt: skip
    if config.router_bias_update_rate > 0:
        raise SetupError(f"--export-adapter with --router-bias-update-rate {config.router_bias_update_rate:g}: "
                         "the router's correction bias changes, which a PEFT adapter cannot carry; export the "
                         "merged model (--export-hf), or keep the rate at 0 (the LoRA default)")  # fmt: skip


def check_output_paths(config: TrainConfig) -> None:
    """Where this run writes, checked before any work (safe_io.check_output_dir): nothing it writes may land
    in an input, the checkout, `.`, or over a non-empty export target without --force."""
    inputs = {"--hf-dir": config.hf_dir, "--load": config.load}
    if config.export_format != "dense" and not config.export_hf:
        raise ValueError(
            f"--export-format {config.export_format}: the format of --export-hf, which is not given"
        )
    try:
        # an export inside the output directory is what users expect (runs/x/hf), not the output directory itself
        # nor one around it
        if config.export_hf:
            check_output_dir(config.export_hf, "--export-hf", force=config.force, inputs=inputs,
                             outputs={"--save": config.save, "--export-adapter": config.export_adapter},
                             within={"--output-dir": config.output_dir})  # fmt: skip
        if config.export_adapter:
            check_output_dir(config.export_adapter, "--export-adapter", force=config.force, inputs=inputs,
                             outputs={"--save": config.save}, within={"--output-dir": config.output_dir})  # fmt: skip
        if (
            config.save
        ):  # a checkpoint directory accumulates tags; resuming in place (--load = --save) is fine
            check_output_dir(config.save, "--save", may_exist=True, inputs={k: v for k, v in inputs.items()
                                                                          if k != "--load"})  # fmt: skip
            check_save_is_this_runs(config)
        check_output_dir(config.output_dir, "--output-dir", may_exist=True,
                         inputs={"--hf-dir": config.hf_dir, "--load": config.load})  # fmt: skip
    except OutputPathError as e:
        raise SetupError(str(e)) from e


def check_save_is_this_runs(config: TrainConfig) -> None:
    """A `--save` holding checkpoints belongs to the run that wrote them: only a run resuming from it (`--load`
    the same directory) continues there, or one told to with --save-into-existing; anything else would replace
    that run's tags of the same name and move its `latest`. Entries of those names that no save wrote (a `step<N>`
    that is not a checkpoint, a `latest` naming none of its checkpoints) are refused whatever the options: a save would
    replace them."""
    foreign = not_ours(config.save or "")
    if foreign:
        raise SetupError(
            f"--save {config.save!r} holds {', '.join(foreign)}, which no save wrote (a step<N> without a "
            "manifest.json, a latest naming none of its checkpoints); this run's saves would replace it. Move it, "
            "or give another --save"
        )
    tags = published_tags(config.save or "")
    # a resume continues there; `--load-model-only` starts a fresh run (step 0), whose saves would replace the tags
    resumes_here = (
        config.load is not None
        and not config.load_model_only
        and os.path.realpath(config.load) == os.path.realpath(config.save or "")
    )
    if resumes_here and config.load_tag:
        later = later_tags(config.save or "", config.load_tag)
        if later:  # a branch from an earlier checkpoint: its saves would replace the first run's later ones
            shown = ", ".join(later[:6]) + (f", ... ({len(later)} tags)" if len(later) > 6 else "")
            raise SetupError(
                f"--load {config.load} --load-tag {config.load_tag} with --save {config.save}: it holds later "
                f"checkpoints ({shown}) that this run's saves would replace. Branch into another --save (e.g. --save "
                f"{os.path.normpath(config.save or '')}-from-{config.load_tag}), or resume from the latest (no "
                "--load-tag)"
            )
    if tags and not resumes_here and not config.save_into_existing:
        shown = ", ".join(tags[:6]) + (f", ... ({len(tags)} tags)" if len(tags) > 6 else "")
        pointer = f"; latest: {latest_tag(config.save or '')}" if has_latest(config.save or "") else ""
        raise SetupError(
            f"--save {config.save!r} already holds checkpoints ({shown}{pointer}) that this run did not write; "
            f"starting there would replace them. Resume from them with --load {config.save}, give another --save, "
            "or pass --save-into-existing"
        )


def check_indexer_loss_trains(config: TrainConfig) -> None:
    """--indexer-loss-coef trains the indexer: refused where the run's trainable set freezes every indexer tensor
    (LoRA, whose adapters do not target the indexer, without a --trainable naming it; a --freeze naming it), since
    the loss would then be computed every step and train nothing."""
    lora = config.lora_rank > 0
    if config.indexer_loss_coef <= 0 or any(
        trains(name, lora, config.trainable, config.freeze, train_indexer=True) for name in INDEXER_TENSORS
    ):
        return
    if config.freeze is not None and any(re.search(config.freeze, name) for name in INDEXER_TENSORS):
        why = f"--freeze {config.freeze!r} freezes it"
    elif lora:
        why = "LoRA's adapters do not target the indexer"
    else:
        why = f"--trainable {config.trainable!r} leaves it out"
    raise SetupError(f"--indexer-loss-coef {config.indexer_loss_coef} trains no indexer tensor ({why}): the loss "
                     f"would train nothing; add --trainable '{INDEXER_PATTERN}' to train the indexer in full (then "
                     "export with --export-hf)")  # fmt: skip


def check_recompute_losses(recompute: str, aux_loss_coef: float, indexer_loss_coef: float) -> None:
    """The losses that full recompute would lose the gradients of: refused with it (the trainer and the planner)."""
    losses = [f"--{name} {coef}" for name, coef in (("aux-loss-coef", aux_loss_coef),
                                                     ("indexer-loss-coef", indexer_loss_coef)) if coef > 0]  # fmt: skip
    if recompute == "full" and losses:
        raise SetupError(
            f"--recompute full with {' and '.join(losses)}: {FULL_RECOMPUTE_LOSSES}; use --recompute selective"
        )


def check_offload(offload_activations: bool, recompute: str) -> None:
    """--offload-activations moves what full recompute keeps: refused without it (the trainer and the planner)."""
    if offload_activations and recompute != "full":
        raise SetupError(f"--offload-activations with --recompute {recompute}: what is offloaded is what full "
                         "recompute keeps of each layer; add --recompute full")  # fmt: skip


def check_optimizer_offload(offload_optimizer: str, zero_stage: int, source: str) -> None:
    """--offload-optimizer cpu partitions the optimizer state to offload it: refused at ZeRO 0 (DeepSpeed would
    ignore the setting), the trainer and the planner; `source`: where the stage came from, as the message says it."""
    if offload_optimizer == "cpu" and zero_stage not in (1, 2):
        raise SetupError(f"--offload-optimizer cpu needs ZeRO 1 or 2; {source}ZeRO {zero_stage} "
                         "(give --deepspeed_config ds_configs/zero2_bf16.json, say)")  # fmt: skip


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The run's `TrainConfig` from its parsed arguments: the defaults resolved, every check that needs no process
    group run; a `SetupError` names the first bad option."""
    cls = TrainConfig
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}  # fmt: skip
    hf_dir = given.get("hf_dir")
    given.setdefault("tokenizer", hf_dir if hf_dir else "bytes")
    if isinstance(given.get("data"), str):  # one source given in code, not on the command line
        given["data"] = (given["data"],)
    options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    config = cls(**options)
    check_inputs(config)
    # defaults that follow the model, whichever route it came by (--hf-dir, --model-config, --load)
    cfg, name = resolve_model(config.hf_dir, config.model_config, config.load, config.load_tag)
    check_seq_length(config.seq_length, cfg)
    if "train_epochs" in given and "train_iters" in given:
        raise SetupError(f"--train-epochs {config.train_epochs:g} and --train-iters {config.train_iters}: give "
                         "one (a --config file's train_iters counts too)")  # fmt: skip
    scale_given = set(given) | ({"train_iters"} if "train_epochs" in given else set())
    missing = [option for option in RUN_SCALE_OPTIONS if option not in scale_given]
    if cfg.hidden_size >= REAL_WIDTH and missing:
        raise SetupError(
            f"{_model_option(config)} is a model of real width ({name}, hidden {cfg.hidden_size}): give "
            f"{', '.join('--' + m.replace('_', '-') for m in missing)} (the defaults are the tiny CPU job's: "
            f"{', '.join(f'{m} {getattr(cls, m)}' for m in missing)}), or start from a recipe: "
            "--config recipes/<one>.toml (recipes/README.md)"
        )
    if "min_lr" not in given:  # the floor follows --lr (a fine-tuning --lr decayed upwards to 3e-4)
        tenth = float(f"{config.lr / 10:.12g}")  # decimal: 3e-3 -> 3e-4 exactly
        config = dataclasses.replace(config, min_lr=tenth)
    elif config.min_lr > config.lr:
        raise SetupError(
            f"--min-lr {config.min_lr:g} is above --lr {config.lr:g}: the cosine decay would rise"
        )
    if "router_bias_update_rate" not in given:
        # LoRA keeps the base as it is, the router's correction bias included (it is part of the base)
        rate = (
            PRESET_ROUTER_BIAS_UPDATE_RATE.get(name, DEFAULT_ROUTER_BIAS_UPDATE_RATE)
            if not config.lora_rank
            else 0.0
        )
        config = dataclasses.replace(config, router_bias_update_rate=rate)
    check_adapter_export(config)
    if "output_dir" not in given:
        config = dataclasses.replace(config, output_dir=os.path.join("runs", name))
    check_output_paths(config)
    return config


def _model_option(config: TrainConfig) -> str:
    if config.hf_dir:
        return f"--hf-dir {config.hf_dir}"
    if config.model_config:
        return f"--model-config {config.model_config}"
    return f"--load {config.load}"
