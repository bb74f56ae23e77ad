"""What a run takes from its --load checkpoint and its LoRA base, checked before the model is built: the global
batch it keeps, the adapters it resumes (the same ones, or refused), the base weights they were trained on (by
full checksum), the data position (over the same data only), the step, the RNG and the learning-rate schedule
(a change announced). `ResumeChecks` is part of the `Trainer` (trainer.py); checkpoints record
`schedule_record` and the adapters' record (training/model_converters.py)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import CheckpointDir
from ..checkpoint.base_weights import HF, NATIVE, base_record, check_base, describe_base
from ..checkpoint.publish import shared_checksums
from ..config import Glm53Config
from .base_quant import BaseQuant, announce_resume, resolve_base_quant
from .config import SetupError, TrainConfig
from .model_converters import LoraAdapters
from .run_plan import RunPlan, agreed, or_setup_error
from .state import TrainingState

if TYPE_CHECKING:
    from .data import DataStream


class ResumeChecks:
    """The `Trainer`'s resume and LoRA-base steps (the attributes below are the Trainer's)."""

    config: TrainConfig
    rank: int
    load_tag: str | None
    base_only: bool
    adapters: LoraAdapters | None
    base: dict[str, Any] | None
    weights_dir: str | None
    base_checkpoint: tuple[str, str] | None
    base_quant: BaseQuant
    cfg: Glm53Config
    stream: DataStream | None
    valid: DataStream | None
    start_step: int
    consumed: int
    resumed_run: str | None
    _saved_state: TrainingState | None = None

    @property
    def plan(self) -> RunPlan:
        raise NotImplementedError

    def _say(self, line: str) -> None:
        raise NotImplementedError

    def saved_state(self) -> TrainingState:
        """--load's recorded training state, read once (the manifest checked; empty for a converted checkpoint)."""
        if self._saved_state is None:
            c = self.config
            self._saved_state = or_setup_error(
                lambda: TrainingState.read(str(c.load), str(self.load_tag)), alike=True
            )
        return self._saved_state

    def _saved_global_batch(self) -> int | None:
        """The global batch the --load checkpoint trained with (a training checkpoint resumed whole), which the run
        keeps unless --global-batch-size gives another (announced in one line). Checkpoints saved before it was
        recorded: consumed samples / steps."""
        c = self.config
        if not c.load or c.load_model_only or self.base_only:
            return None
        saved = self.saved_state().saved_global_batch()
        if saved and c.global_batch_size and c.global_batch_size != saved and self.rank == 0:
            print(f"--global-batch-size {c.global_batch_size}: the checkpoint trained with {saved} sequences per "
                  f"step; this run continues with {c.global_batch_size}", file=sys.stderr)  # fmt: skip
        return int(saved) if saved else None

    def _adapters_against_load(self) -> bool:
        """Whether --load gives a LoRA run its base only (a checkpoint without adapters: fresh adapters, optimizer
        state and step 0). A checkpoint holding adapters resumes only with the same ones (rank, alpha, dropout,
        targets): anything else would silently change the experiment, so it is refused, naming both."""
        c = self.config
        mine = self.adapters.record if self.adapters is not None else None
        held = any(LoraAdapters.adds(k) for k in CheckpointDir(c.load or "", str(self.load_tag)).keys())
        if not held:
            return mine is not None
        stored = self.saved_state().lora
        if stored != mine:
            raise SetupError(
                f"--load {c.load}: the checkpoint holds LoRA adapters ({LoraAdapters.describe(stored)}); this run asks for "
                f"{LoraAdapters.describe(mine)}. Give the same --lora-rank / --lora-alpha / --lora-dropout / --lora-targets "
                "to resume it, or export it merged (--export-hf) and start from that"
            )
        return False

    def _find_base(self) -> None:
        """A LoRA run's base (`self.base`) and where its weights come from. A fresh run's: --hf-dir, or --load of a
        checkpoint without adapters. A run resuming an adapter checkpoint (adapters without their base): the base
        it records, from --hf-dir when given, else from the recorded path (announced); either is checked file by
        file against the record (other base weights would silently change what the adapters mean). The checksums
        of a released-layout base are spread over the ranks (`shared_checksums`)."""
        c = self.config
        source = agreed(self._base_source)
        if source is None:
            return
        kind, path, tag, recorded, option = source
        try:
            given = base_record(kind, path, tag, checksums=shared_checksums)
        except (OSError, ValueError) as e:  # alike on every rank (the checksums' failures are gathered)
            if recorded is not None and not c.hf_dir:
                message = (f"--load {c.load}: the adapters' base weights, {describe_base(recorded)}, cannot be read "
                           f"({e}); give the base with --hf-dir")  # fmt: skip
            else:
                message = f"{option}: the base weights cannot be read ({e})"
            error = SetupError(message)
            error.agreed = True  # type: ignore[attr-defined]
            raise error from e
        if recorded is not None:
            notice = agreed(lambda: check_base(recorded, given, option))
            if notice:
                self._say(notice)
            if given["kind"] == HF:
                self.weights_dir = given["path"]
            else:
                self.base_checkpoint = (given["path"], given["tag"])
        self.base = given

    def _resolve_base_quant(self) -> None:
        """--base-quant against the weights the run starts from (after `_find_base`: a resume's recorded base),
        said in one line and recorded with the base; a resume keeping it another way is announced."""
        c = self.config
        self.base_quant = agreed(lambda: resolve_base_quant(c, self.cfg, self.weights_dir,
                                                            self.cfg.num_nextn_predict_layers > 0))  # fmt: skip
        if self.base_quant.line:
            self._say(self.base_quant.line)
        if c.load and self.adapters is not None and not self.base_only:
            notice = announce_resume(self.saved_state().base, self.base_quant)
            if notice:
                self._say(notice)
        if self.base is not None:
            self.base = {**self.base, "kept": self.base_quant.kept}

    def _base_source(self) -> tuple[str, str, str | None, dict[str, Any] | None, str] | None:
        """(kind, path, tag, the record to check it against or None, the option that gave it) of a LoRA run's base;
        None where there is none to record (random initial weights) or the checkpoint holds its base too."""
        c = self.config
        ckpt = CheckpointDir(c.load, str(self.load_tag)) if c.load else None
        if ckpt is None or self.base_only:
            if ckpt is not None:
                return NATIVE, str(c.load), self.load_tag, None, f"--load {c.load}"
            return (HF, c.hf_dir, None, None, f"--hf-dir {c.hf_dir}") if c.hf_dir else None
        recorded = self.saved_state().base
        if not ckpt.adapters_only:  # a LoRA checkpoint holding its base too
            self.base = recorded
            return None
        if recorded is None:
            raise SetupError(f"--load {c.load}: an adapter checkpoint that does not record its base weights")
        if c.hf_dir:
            return HF, c.hf_dir, None, recorded, f"--hf-dir {c.hf_dir}"
        return (
            recorded["kind"],
            recorded["path"],
            recorded.get("tag"),
            recorded,
            f"--load {c.load} (the base it records)",
        )

    def _check_resume_data(self, saved: TrainingState) -> None:
        """Before any model is built: a training checkpoint resumes only over the same data (its identity: corpus,
        sample length, seed, the sample range --valid-split leaves to training); anything else would re-read or
        skip samples, or train on held-out ones, so it is refused naming the option."""
        assert self.stream is not None
        c = self.config
        if saved.step == 0:
            return
        if "consumed_samples" not in saved.recorded:
            raise SetupError(f"--load {c.load}: the checkpoint does not record its data position (consumed "
                             "samples); it predates this trainer")  # fmt: skip
        stored, now = dict(saved.data), self.stream.identity
        if ("mixture" in stored) != ("mixture" in now):
            counts = [len(d["mixture"]) if "mixture" in d else 1 for d in (now, stored)]  # type: ignore[arg-type]
            raise SetupError(f"--load {c.load}: this run reads {counts[0]} --data source(s), the checkpoint trained "
                             f"on {counts[1]}; resuming would re-read or skip samples (use the checkpoint's --data, "
                             "or start from its weights with --load-model-only: fresh optimizer state, step 0)")  # fmt: skip
        if "mixture" in now:
            self._check_mixture(list(stored["mixture"]), list(now["mixture"]))  # type: ignore[call-overload]
            return
        if (
            "samples" not in stored
        ):  # written before the range was recorded always: unsplit runs read it whole
            held = self.valid.num_samples if c.valid_split and self.valid is not None else 0
            stored["samples"] = [0, self.stream.num_samples + held]
        if stored["samples"] != self.stream.identity["samples"] and not self._corpus_changed(stored):
            saved_range, this_range = list(stored["samples"]), list(self.stream.identity["samples"])  # type: ignore[call-overload]
            (a, b), (x, y) = saved_range, this_range
            raise SetupError(
                f"--valid-split {c.valid_split:g}: this run trains on samples [{x}, {y}) of --data, the checkpoint "
                f"trained on [{a}, {b}) (another --valid-split); resuming would train on held-out samples or skip "
                "some. Resume with the checkpoint's --valid-split, or start from its weights with --load-model-only"
            )
        unrecorded = [k for k in self.stream.identity if k not in stored]
        if unrecorded and self.rank == 0:  # saved before glm53_ds recorded them
            print(f"--load {c.load}: the checkpoint does not record the data's {', '.join(unrecorded)}; those are "
                  "not checked", file=sys.stderr)  # fmt: skip
        differ = {
            k: (v, stored[k]) for k, v in self.stream.identity.items() if k in stored and stored[k] != v
        }
        if differ:
            shown = ", ".join(
                f"{k} {now} here, {then} in the checkpoint" for k, (now, then) in differ.items()
            )
            raise SetupError(
                f"--load {c.load}: the data differs from the checkpoint's ({shown}); resuming would re-read or skip "
                "samples (use the same --data, --seq-length and --seed, or start from its weights with "
                "--load-model-only: fresh optimizer state, step 0)"
            )

    def _corpus_changed(self, stored: dict[str, Any]) -> bool:
        """Whether the checkpoint's corpus is another one (its recorded content fingerprint or size differs): then
        a different sample range is the data's change, not --valid-split's, and is said as such."""
        assert self.stream is not None
        now = self.stream.identity
        return any(k in stored and stored[k] != now[k] for k in ("fingerprint", "tokens", "rows") if k in now)

    def _check_mixture(self, saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> None:
        """A mixture resumes over the same sources (by content, not path), weights and order."""
        c = self.config
        fix = ("resuming would re-read or skip samples (the checkpoint's sources, weights and order, --seq-length, "
               "--seed and --valid-split; or start from its weights with --load-model-only: fresh optimizer state, "
               "step 0)")  # fmt: skip
        if len(saved) != len(now):
            raise SetupError(f"--load {c.load}: this run mixes {len(now)} --data sources, the checkpoint "
                             f"{len(saved)} ({' '.join(str(s['data']) for s in saved)}); {fix}")  # fmt: skip
        for k, (then, here) in enumerate(zip(saved, now, strict=True)):
            differ = [f"{key} {here[key]} here, {then[key]} in the checkpoint" for key in here
                      if key != "data" and key in then and then[key] != here[key]]  # fmt: skip
            if differ:
                raise SetupError(f"--load {c.load}: --data source {k + 1} ({here['data']}; the checkpoint's "
                                 f"{then['data']}) differs: {', '.join(differ)}; {fix}")  # fmt: skip

    def _resume(self, saved: TrainingState) -> None:
        """Step, data position (consumed samples), RNG from a training checkpoint (its data checked in set-up); a
        converted (model-only) one starts at step 0. A schedule that differs from the checkpoint's is announced."""
        c = self.config
        self.start_step = saved.step
        where = os.path.join(c.load or "", str(self.load_tag))
        if self.start_step == 0:
            what = "the base weights" if self.base_only else "the weights"
            fresh = "fresh LoRA adapters, " if self.base_only else ""
            self._say(f"loaded {what} of {where} ({fresh}fresh optimizer state, step 0, data from the start)")
            return
        self.consumed = saved.consumed_samples
        self.resumed_run = saved.run
        if saved.rng is not None:
            torch.set_rng_state(saved.rng)
        self._say(f"resumed from {where}: step {self.start_step}, {self.consumed} consumed samples, global batch "
                  f"{self.plan.global_batch}")  # fmt: skip
        schedule = saved.schedule
        if schedule and schedule != schedule_record(c):
            before = dataclasses.replace(c, **schedule).lr_at(self.start_step)
            changed = ", ".join(f"--{k.replace('_', '-')} {schedule[k]} -> {v}" for k, v in schedule_record(c).items()
                                if schedule.get(k) != v)  # fmt: skip
            self._say(f"learning-rate schedule: {changed} (the checkpoint's); at step {self.start_step} the "
                      f"learning rate is {c.lr_at(self.start_step):.3g} (it would have been {before:.3g})")  # fmt: skip


def schedule_record(config: TrainConfig) -> dict[str, Any]:
    """What fixes the learning rate at each step (`TrainConfig.lr_at`), recorded by checkpoints."""
    return {k: getattr(config, k) for k in ("lr", "min_lr", "warmup", "train_iters")}
