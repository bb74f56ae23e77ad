"""`TrainConfig`: the trainer's typed configuration, built and validated once from the command line.

Everything `deepspeed launch/train.py` accepts lands here with its defaults resolved (data, tokenizer, output
directory, router-bias rate by preset); checks that need no process group run in `from_args` and fail with
one `SetupError` naming the option. Checks that need the world size (layout, batch sizes) run in the trainer's
set-up, still before the model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointDir
from ..checkpoint.directory import has_latest, latest_tag
from ..config import Glm53Config
from ..layers.lora import LORA_TARGETS, LoraSpec
from ..safe_io import OutputPathError, check_output_dir, published_tags
from ..transformer_config import FULL_RECOMPUTE_LOSSES
from .data import check_data_path
from .packing import LONG_DOCUMENTS
from .presets import (
    DEFAULT_ROUTER_BIAS_UPDATE_RATE,
    PRESET_ROUTER_BIAS_UPDATE_RATE,
    PRESETS,
    named_config,
    preset,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(REPO_ROOT, "data", "tiny_corpus.txt")
RECOMPUTE = ("none", "selective", "full")


def recompute_overrides(mode: str) -> dict[str, Any]:
    """The transformer-config fields of a `--recompute` mode: selective recomputes the mHC mixes and the MLP / MoE
    in backward; full recomputes each whole layer (megatron's uniform method, one layer per checkpoint)."""
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp", "moe"])
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if mode != "none":
        raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {mode!r}")
    return {}


class SetupError(ValueError):
    """A problem found before training starts; the message names the option and values."""


def check_seq_length(seq_length: int, cfg: Glm53Config) -> None:
    """A row longer than the model's positions is refused, by the trainer, the planner and the dry run alike."""
    if seq_length > cfg.max_position_embeddings:
        raise SetupError(f"--seq-length {seq_length} is above the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings} (its config); raise that in the config to train longer "
                         "rows")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    # model
    hf_dir: str | None = None
    model_config: str | None = None  # a config.json or a preset name; None: tiny, or --hf-dir's config
    mtp_loss_weight: float | None = None
    no_mtp: bool = False
    recompute: str = "none"
    aux_loss_coef: float = 0.0
    indexer_loss_coef: float = 0.0  # > 0: train the DSA indexers by their KL loss (else they stay frozen)
    loss_chunk_mib: int = (
        256  # the LM / MTP head's chunk of fp32 logits (layers/chunked_ce.py); 0 = materialised
    )
    # fine-tuning: LoRA adapters and which parameters train
    lora_rank: int = 0  # > 0: LoRA adapters of this rank on --lora-targets; the base frozen
    lora_alpha: float | None = None  # the adapters' scale is alpha / rank; None: alpha = rank
    lora_dropout: float = 0.0
    lora_targets: str = ",".join(LORA_TARGETS)
    trainable: str | None = None  # regex of native names that train (with LoRA: besides the adapters)
    freeze: str | None = None  # regex of native names that stay frozen (applied last)
    # parallelism
    ep: int = 1
    etp: int = 1
    sp: int = 1  # sequence parallel: each sequence split contiguously over this many ranks
    # data
    data: str = DEFAULT_DATA
    tokenizer: str = "bytes"
    pack: bool = False  # documents packed into rows with their boundaries (chat data: always)
    # validation (training/evaluation.py): K global batches of --valid-data, every N steps and at the end
    valid_data: str | None = None
    valid_split: float = 0.0  # or the last fraction of --data held out
    eval_interval: int = 0  # 0: at the end only
    eval_iters: int = 10
    eval_at_start: bool = False
    long_documents: str = "split"  # packed data: a document longer than a row is split, truncated or dropped
    seq_length: int = 64
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # None: micro batch x world size
    seed: int = 1234
    # optimization
    train_iters: int = 60
    lr: float = 3e-3
    min_lr: float = 3e-4  # the tiny job's; not given: --lr / 10
    warmup: int = 5
    weight_decay: float = 0.01
    no_decay_pattern: str | None = (
        None  # regex of parameter names exempt from weight decay (besides biases / 1-D)
    )
    clip_grad: float = 1.0
    router_bias_update_rate: float = DEFAULT_ROUTER_BIAS_UPDATE_RATE
    # checkpoints and output
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    load_tag: str | None = None
    load_model_only: bool = False  # --load's weights only: fresh optimizer state, step 0, data from the start
    save_into_existing: bool = (
        False  # a run not resuming from --save may still write there (replacing same-name tags)
    )
    export_hf: str | None = None
    export_adapter: str | None = None  # a LoRA run's adapters as a PEFT adapter (convert/export_adapter.py)
    force: bool = (
        False  # --export-hf may write into an existing non-empty directory (replacing only its files)
    )
    output_dir: str = os.path.join("runs", "tiny")
    check_replicas_interval: int = 0
    log_interval: int = 10
    peak_tflops: float | None = None  # the GPU's bf16 peak for MFU (default: known by the GPU's name)
    tensorboard_dir: str | None = None
    wandb_project: str | None = None  # also log to Weights & Biases (rank 0; the optional wandb extra)
    wandb_mode: str = "online"  # or "offline": no network, under --output-dir (wandb sync uploads it)
    wandb_name: str | None = None
    deepspeed_config: str | None = None
    # planning (python -m glm53_ds.plan --config reads them; the trainer compares gpus with its world)
    gpus: int | None = None
    gpu_memory: str = "141GB"

    def lr_at(self, step: int) -> float:
        """Linear warmup to --lr over --warmup steps, then cosine decay to --min-lr at --train-iters."""
        if self.warmup > 0 and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(self.train_iters - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """Resolve defaults and validate; a `SetupError` names the first bad option."""
        given = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(cls)
            if getattr(args, f.name, None) is not None
        }
        given["no_mtp"] = bool(getattr(args, "no_mtp", False))
        given["force"] = bool(getattr(args, "force", False))
        given["save_into_existing"] = bool(getattr(args, "save_into_existing", False))
        given["eval_at_start"] = bool(getattr(args, "eval_at_start", False))
        hf_dir = given.get("hf_dir")
        given.setdefault("tokenizer", hf_dir if hf_dir else "bytes")
        config = cls(**given)
        config.validate_inputs()
        # defaults that follow the model, whichever route it came by (--hf-dir, --model-config, --load)
        cfg, name = resolve_model(config.hf_dir, config.model_config, config.load, config.load_tag)
        check_seq_length(config.seq_length, cfg)
        missing = [option for option in RUN_SCALE_OPTIONS if option not in given]
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
        config.check_adapter_export()
        if "output_dir" not in given:
            config = dataclasses.replace(config, output_dir=os.path.join("runs", name))
        config.check_output_paths()
        return config

    def validate(self) -> None:
        self.validate_inputs()
        self.check_output_paths()

    def validate_inputs(self) -> None:
        """Every option but the output paths (those follow once the defaults are resolved)."""

        def positive(name: str, value: int) -> None:
            if value < 1:
                raise SetupError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

        for name in ("seq_length", "micro_batch_size", "ep", "etp", "sp"):
            positive(name, getattr(self, name))
        if self.global_batch_size is not None:
            positive("global_batch_size", self.global_batch_size)
        for name in ("train_iters", "warmup", "save_interval", "check_replicas_interval", "log_interval",
                     "loss_chunk_mib", "eval_interval"):  # fmt: skip
            if getattr(self, name) < 0:
                raise SetupError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "router_bias_update_rate", "aux_loss_coef",
                     "indexer_loss_coef"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SetupError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        positive("eval_iters", self.eval_iters)
        if self.gpus is not None:
            positive("gpus", self.gpus)
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0):
            raise SetupError(f"--peak-tflops must be a finite number > 0, got {self.peak_tflops}")
        if not (math.isfinite(self.valid_split) and 0.0 <= self.valid_split <= 0.5):
            raise SetupError(f"--valid-split must be in [0, 0.5] (the fraction of --data held out), got "
                             f"{self.valid_split}")  # fmt: skip
        if self.valid_split and self.valid_data:
            raise SetupError("--valid-split with --valid-data: give one validation source")
        if self.valid_data is None and not self.valid_split:
            given = [f"--{n.replace('_', '-')}" for n in ("eval_interval", "eval_iters", "eval_at_start")
                     if getattr(self, n) != TrainConfig.__dataclass_fields__[n].default]  # fmt: skip
            if given:
                raise SetupError(f"{', '.join(given)} without --valid-data or --valid-split: give the validation "
                                 "data")  # fmt: skip
        for option, data_path in (("--data", self.data), ("--valid-data", self.valid_data)):
            try:
                if data_path is not None:
                    check_data_path(data_path, option)  # in the first seconds, before DeepSpeed starts
            except FileNotFoundError as e:
                raise SetupError(str(e)) from e
        if self.wandb_mode not in ("online", "offline"):
            raise SetupError(f"--wandb-mode must be online or offline, got {self.wandb_mode!r}")
        if self.wandb_project is None and (self.wandb_mode != "online" or self.wandb_name):
            raise SetupError("--wandb-mode / --wandb-name without --wandb-project: give the W&B project")
        if self.wandb_project is not None and importlib.util.find_spec("wandb") is None:
            raise SetupError(f"--wandb-project {self.wandb_project!r}: the wandb package is not installed "
                             "(pip install \"glm53_ds[wandb]\")")  # fmt: skip
        if self.mtp_loss_weight is not None and not (
            math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0
        ):
            raise SetupError(f"--mtp-loss-weight must be a finite number >= 0, got {self.mtp_loss_weight}")
        if self.no_decay_pattern is not None:
            try:
                re.compile(self.no_decay_pattern)
            except re.error as e:
                raise SetupError(
                    f"--no-decay-pattern {self.no_decay_pattern!r}: not a regular expression ({e})"
                ) from e
        for option, pattern in (("--trainable", self.trainable), ("--freeze", self.freeze)):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise SetupError(f"{option} {pattern!r}: not a regular expression ({e})") from e
        if self.lora_rank < 0:
            raise SetupError(f"--lora-rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.lora_rank == 0:
            given = [f"--{n.replace('_', '-')}" for n in ("lora_alpha", "lora_dropout", "lora_targets")
                     if getattr(self, n) != TrainConfig.__dataclass_fields__[n].default]  # fmt: skip
            if given:
                raise SetupError(
                    f"{', '.join(given)} without --lora-rank: give --lora-rank R for LoRA adapters"
                )
        else:
            try:
                self.lora_spec()
            except ValueError as e:
                raise SetupError(f"--lora-rank / --lora-alpha / --lora-dropout / --lora-targets: {e}") from e
        if self.long_documents not in LONG_DOCUMENTS:
            raise SetupError(f"--long-documents must be one of {LONG_DOCUMENTS}, got {self.long_documents!r}")
        if self.recompute not in RECOMPUTE:
            raise SetupError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.recompute == "full" and (self.aux_loss_coef > 0 or self.indexer_loss_coef > 0):
            raise SetupError(
                f"--recompute full with --aux-loss-coef {self.aux_loss_coef} / --indexer-loss-coef "
                f"{self.indexer_loss_coef}: {FULL_RECOMPUTE_LOSSES}; use --recompute selective"
            )
        if self.hf_dir and not os.path.isfile(os.path.join(self.hf_dir, "config.json")):
            raise SetupError(f"--hf-dir {self.hf_dir!r}: no config.json there")
        if self.model_config and self.model_config not in PRESETS and not os.path.isfile(self.model_config):
            raise SetupError(
                f"--model-config {self.model_config!r}: not a file and not a preset {sorted(PRESETS)}"
            )
        for option, path in (("--hf-dir", self.hf_dir and os.path.join(self.hf_dir, "config.json")),
                             ("--model-config", not self.hf_dir and self.model_config not in PRESETS and self.model_config)):  # fmt: skip
            if path:
                check_model_config_file(option, path)
        if self.load:
            if self.load_tag:
                if not os.path.isdir(os.path.join(self.load, self.load_tag)):
                    raise SetupError(
                        f"--load {self.load!r}: no checkpoint there (tag {self.load_tag!r} is missing)"
                    )
            elif not has_latest(self.load):
                raise SetupError(f"--load {self.load!r}: no checkpoint there (the file 'latest' is missing)")
        if self.deepspeed_config and not os.path.isfile(self.deepspeed_config):
            raise SetupError(f"--deepspeed_config {self.deepspeed_config!r}: no such file")

    def lora_spec(self) -> LoraSpec | None:
        """The LoRA adapters the run trains (None: no LoRA); a ValueError names a bad value."""
        if self.lora_rank == 0:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        alpha = float(self.lora_rank) if self.lora_alpha is None else self.lora_alpha
        return LoraSpec(
            rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout, targets=targets, seed=self.seed
        )

    def check_adapter_export(self) -> None:
        """--export-adapter writes the adapters alone: refused before any work where the run changes anything else
        (a PEFT adapter would drop it silently)."""
        if not self.export_adapter:
            return
        if not self.lora_rank:
            raise SetupError("--export-adapter without --lora-rank: only a LoRA run has adapters to export (use "
                             "--export-hf for the model)")  # fmt: skip
        if self.trainable:
            raise SetupError(f"--export-adapter with --trainable {self.trainable!r}: the run trains tensors besides "
                             "the adapters, which a PEFT adapter cannot carry; export the merged model "
                             "(--export-hf)")  # fmt: skip
        if self.router_bias_update_rate > 0:
            raise SetupError(f"--export-adapter with --router-bias-update-rate {self.router_bias_update_rate:g}: "
                             "the router's correction bias changes, which a PEFT adapter cannot carry; export the "
                             "merged model (--export-hf), or keep the rate at 0 (the LoRA default)")  # fmt: skip

    def check_output_paths(self) -> None:
        """Where this run writes, checked before any work (safe_io.check_output_dir): nothing it writes may land
        in an input, the checkout, `.`, or over a non-empty export target without --force."""
        inputs = {"--hf-dir": self.hf_dir, "--load": self.load}
        try:
            if self.export_hf:
                check_output_dir(self.export_hf, "--export-hf", force=self.force, inputs=inputs,
                                 outputs={"--save": self.save, "--output-dir": self.output_dir,
                                          "--export-adapter": self.export_adapter})  # fmt: skip
            if self.export_adapter:
                check_output_dir(self.export_adapter, "--export-adapter", force=self.force, inputs=inputs,
                                 outputs={"--save": self.save, "--output-dir": self.output_dir})  # fmt: skip
            if (
                self.save
            ):  # a checkpoint directory accumulates tags; resuming in place (--load = --save) is fine
                check_output_dir(self.save, "--save", may_exist=True, inputs={k: v for k, v in inputs.items()
                                                                              if k != "--load"})  # fmt: skip
                self.check_save_is_this_runs()
            check_output_dir(self.output_dir, "--output-dir", may_exist=True,
                             inputs={"--hf-dir": self.hf_dir, "--load": self.load})  # fmt: skip
        except OutputPathError as e:
            raise SetupError(str(e)) from e

    def check_save_is_this_runs(self) -> None:
        """A `--save` holding checkpoints belongs to the run that wrote them: only a run resuming from it (`--load`
        the same directory) continues there, or one told to with --save-into-existing; anything else would replace
        that run's tags of the same name and move its `latest`."""
        tags = published_tags(self.save or "")
        resumes_here = self.load is not None and os.path.realpath(self.load) == os.path.realpath(
            self.save or ""
        )
        if tags and not resumes_here and not self.save_into_existing:
            shown = ", ".join(tags[:6]) + (f", ... ({len(tags)} tags)" if len(tags) > 6 else "")
            pointer = f"; latest: {latest_tag(self.save or '')}" if has_latest(self.save or "") else ""
            raise SetupError(
                f"--save {self.save!r} already holds checkpoints ({shown}{pointer}) that this run did not write; "
                f"starting there would replace them. Resume from them with --load {self.save}, give another --save, "
                "or pass --save-into-existing"
            )


def resolve_model(
    hf_dir: str | None, model_config: str | None, load: str | None, load_tag: str | None
) -> tuple[Glm53Config, str]:
    """(the model config the run builds, its name). The config: --hf-dir's config.json, else --model-config (a
    file or a preset), else the one --load's checkpoint records (a converted or training checkpoint trains as
    itself), else the tiny preset. The name (runs/<name>, the preset defaults) comes from the model, not from the
    route: the preset it equals, whichever way it came; else its source's base name."""
    if hf_dir:
        cfg, name = Glm53Config.from_hf(hf_dir), os.path.basename(os.path.normpath(hf_dir))
        if model_config:  # e.g. a recipe's model beside the weights given on the command line: the same model
            named = named_config(model_config)
            theirs, mine = named.to_text_dict(), cfg.to_text_dict()
            differ = sorted(
                k for k in theirs.keys() | mine.keys() if k not in RUN_FIELDS and theirs.get(k) != mine.get(k)
            )
            if differ:
                raise SetupError(
                    f"--hf-dir {hf_dir} is not --model-config {model_config}: they differ in "
                    f"{', '.join(f'{k} ({mine.get(k)!r} vs {theirs.get(k)!r})' for k in differ[:3])}"
                    f"{' and more' if len(differ) > 3 else ''}; give one of them"
                )
    elif model_config:
        cfg = named_config(model_config)
        name = (
            model_config if model_config in PRESETS else os.path.splitext(os.path.basename(model_config))[0]
        )
    elif load:
        try:
            stored = CheckpointDir(load, load_tag or None).meta.get("config")
        except (OSError, ValueError) as e:
            raise SetupError(f"--load {load!r}: {e}") from e
        if not stored:
            raise SetupError(
                f"--load {load!r}: the checkpoint does not record its model config; give --model-config"
            )
        cfg, name = Glm53Config.from_text_dict(stored), os.path.basename(os.path.normpath(load))
    else:
        cfg, name = preset("tiny"), "tiny"
    mine = {k: v for k, v in cfg.to_text_dict().items() if k not in RUN_FIELDS}
    same = [n for n, make in PRESETS.items() if {k: v for k, v in make().to_text_dict().items() if k not in RUN_FIELDS} == mine]  # fmt: skip
    return cfg, same[0] if same else name


# A model this wide is not a toy: the tiny CPU job's defaults of these options (64-token rows, lr 3e-3, 60 steps,
# the shipped 40 KB corpus) would make a run that means nothing, so they must be given (flags or --config).
REAL_WIDTH = 1024
RUN_SCALE_OPTIONS = ("data", "seq_length", "micro_batch_size", "lr", "train_iters")


def _model_option(config: TrainConfig) -> str:
    if config.hf_dir:
        return f"--hf-dir {config.hf_dir}"
    if config.model_config:
        return f"--model-config {config.model_config}"
    return f"--load {config.load}"


# Config fields a run may set itself (they do not make another model).
RUN_FIELDS = frozenset({"mtp_loss_weight"})

# Keys a config.json must give (transformers would fall back to the released sizes without a word).
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_model_config_file(option: str, path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise SetupError(f"{option}: {path}:{e.lineno}: not valid JSON ({e.msg})") from e
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(text, dict):
        raise SetupError(f"{option}: {path}: expected a JSON object")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in text]
    if missing:
        raise SetupError(
            f"{option}: {path} does not give {', '.join(missing)} (refusing to assume the released sizes)"
        )
