"""`TrainConfig`: the trainer's typed configuration, built and validated once from the command line.

Everything `deepspeed launch/train.py` accepts lands here with its defaults resolved (data, tokenizer, output
directory, router-bias rate by preset); checks that need no process group run in `from_args` and fail with
one `SetupError` naming the option. Checks that need the world size (layout, batch sizes) run in the trainer's
set-up, still before the model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

from .presets import DEFAULT_ROUTER_BIAS_UPDATE_RATE, PRESET_ROUTER_BIAS_UPDATE_RATE, PRESETS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(REPO_ROOT, "data", "tiny_corpus.txt")
RECOMPUTE = ("none", "selective", "full")


class SetupError(ValueError):
    """A problem found before training starts; the message names the option and values."""


@dataclass(frozen=True)
class TrainConfig:
    # model
    hf_dir: str | None = None
    model_config: str | None = None  # a config.json or a preset name; None: tiny, or --hf-dir's config
    mtp_loss_weight: float | None = None
    no_mtp: bool = False
    recompute: str = "none"
    aux_loss_coef: float = 0.0
    # parallelism
    ep: int = 1
    etp: int = 1
    # data
    data: str = DEFAULT_DATA
    tokenizer: str = "bytes"
    seq_length: int = 64
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # None: micro batch x world size
    seed: int = 1234
    # optimization
    train_iters: int = 60
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    router_bias_update_rate: float = DEFAULT_ROUTER_BIAS_UPDATE_RATE
    # checkpoints and output
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    load_tag: str | None = None
    export_hf: str | None = None
    output_dir: str = os.path.join("runs", "tiny")
    check_replicas_interval: int = 0
    log_interval: int = 10
    tensorboard_dir: str | None = None
    deepspeed_config: str | None = None

    @property
    def preset(self) -> str | None:
        """The preset the run builds, or None when the model comes from --hf-dir or a config file."""
        if self.hf_dir or (self.model_config and self.model_config not in PRESETS):
            return None
        return self.model_config or "tiny"

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
        hf_dir, model_config = given.get("hf_dir"), given.get("model_config")
        preset = (
            None if hf_dir or (model_config and model_config not in PRESETS) else (model_config or "tiny")
        )
        given.setdefault("tokenizer", hf_dir if hf_dir else "bytes")
        given.setdefault(
            "router_bias_update_rate",
            PRESET_ROUTER_BIAS_UPDATE_RATE.get(preset or "", DEFAULT_ROUTER_BIAS_UPDATE_RATE),
        )
        if "output_dir" not in given:
            name = preset or (
                "hf" if hf_dir else os.path.splitext(os.path.basename(model_config or "model"))[0]
            )
            given["output_dir"] = os.path.join("runs", name)
        config = cls(**given)
        config.validate()
        return config

    def validate(self) -> None:
        def positive(name: str, value: int) -> None:
            if value < 1:
                raise SetupError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

        for name in ("seq_length", "micro_batch_size", "ep", "etp"):
            positive(name, getattr(self, name))
        if self.global_batch_size is not None:
            positive("global_batch_size", self.global_batch_size)
        for name in ("train_iters", "warmup", "save_interval", "check_replicas_interval", "log_interval"):
            if getattr(self, name) < 0:
                raise SetupError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "router_bias_update_rate", "aux_loss_coef"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SetupError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if self.mtp_loss_weight is not None and not (
            math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0
        ):
            raise SetupError(f"--mtp-loss-weight must be a finite number >= 0, got {self.mtp_loss_weight}")
        if self.recompute not in RECOMPUTE:
            raise SetupError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.hf_dir and not os.path.isfile(os.path.join(self.hf_dir, "config.json")):
            raise SetupError(f"--hf-dir {self.hf_dir!r}: no config.json there")
        if self.model_config and self.model_config not in PRESETS and not os.path.isfile(self.model_config):
            raise SetupError(
                f"--model-config {self.model_config!r}: not a file and not a preset {sorted(PRESETS)}"
            )
        if self.load:
            tag_ok = self.load_tag and os.path.isdir(os.path.join(self.load, self.load_tag))
            if not tag_ok and not os.path.isfile(os.path.join(self.load, "latest")):
                what = f"tag {self.load_tag!r}" if self.load_tag else "the file 'latest'"
                raise SetupError(f"--load {self.load!r}: no checkpoint there ({what} is missing)")
        if self.deepspeed_config and not os.path.isfile(self.deepspeed_config):
            raise SetupError(f"--deepspeed_config {self.deepspeed_config!r}: no such file")
