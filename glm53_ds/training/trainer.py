"""`Trainer`: the training loop behind `deepspeed launch/train.py`, driven by a `TrainConfig`.

    setup()        everything that can be wrong is checked before the model is built (data, tokenizer,
                   checkpoint dirs, layout, batch sizes vs the DeepSpeed config, token ids vs vocab); then the
                   layout's process groups, the model with this rank's experts (from --hf-dir: only its
                   tensors), `glm53_ds.build_engine`, and --load
    train_step(s)  one optimizer step over the global batch; one host sync for the NaN check and the logged loss
    save(s)        replica check + checkpoint (engine/checkpoint.py)
    finish()       final save, loss curve, --export-hf, --export-adapter
`run()` does all of it; `main()` maps failures to exit codes (2: set-up, 3: training stopped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..checkpoint import CheckpointDir, CheckpointError, layout_record, verify_checkpoint
from ..checkpoint.base_weights import HF, NATIVE, base_record, check_base, describe_base
from ..checkpoint.publish import shared_checksums
from ..config import Glm53Config
from ..engine import (
    Glm53Engine,
    NonFiniteGradientError,
    build_engine,
    check_checkpoint_fits,
    close_distributed,
    describe_param_groups,
    export_engine_to_hf,
    export_engine_to_peft,
    init_distributed,
    load_checkpoint,
    read_client_state,
    save_checkpoint,
)
from ..flops import StepFlops, device_peak_tflops, step_flops
from ..hf_loader import SafetensorsCheckpoint, checkpoint_has_mtp, load_hf_state_into
from ..layers.lora import LoraSpec, is_lora_param
from ..layers.lora_targets import apply_lora
from ..layers.moe import update_router_bias
from ..model import Glm53Model, LossParts
from ..parallel.layout import ParallelLayout, init_layout, validate_layout
from ..parallel.replicas import check_replicas
from ..safe_io import DirectoryLock, DiskFull
from ..transformer_config import make_transformer_config
from .args import build_parser
from .config import SetupError, TrainConfig, recompute_overrides, resolve_model
from .data import SampleStream, load_tokenizer, open_stream
from .metrics import MetricsWriter, StepMetrics, WandbRun, plot_loss
from .packing import Batch, PackedRowStream, hold_out
from .run_file import parse_with_config, write_run_file
from .stop_signals import Interrupted, StopSignals, signal_name
from .trainable import select_trainable

__all__ = ["SetupError", "Trainer", "TrainingStopped", "main"]


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (a non-finite loss or gradient): decided on every rank alike."""


def agreed(fn: Any) -> Any:
    """Run a set-up step on every rank and agree on its outcome: when any rank fails, every rank raises the same
    `SetupError` (the first failing rank's message, naming that rank), so that it is reported once and no rank
    waits for another that has left. Only for steps without collectives of their own."""
    try:
        result, failure = fn(), None
    except (OSError, ValueError) as e:  # SetupError is a ValueError
        result, failure = None, str(e)
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    found = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if found:
        rank, message = found[0]
        error = SetupError(message + (f" (found on rank {rank})" if dist.get_world_size() > 1 else ""))
        error.agreed = True  # type: ignore[attr-defined]
        raise error
    return result


def model_config(config: TrainConfig) -> Glm53Config:
    """The model the run builds (`resolve_model`: --hf-dir, --model-config, --load's own, or tiny), with the run's
    MTP choices."""
    cfg, _ = resolve_model(config.hf_dir, config.model_config, config.load, config.load_tag)
    if config.mtp_loss_weight is not None:
        cfg = cfg.replace(mtp_loss_weight=config.mtp_loss_weight)
    if config.no_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    return cfg


def gradient_accumulation(config: TrainConfig, world: int, global_batch: int) -> int:
    """Micro-batches per step: global batch = micro batch x (world / SP) x GAS (an SP group reads one set)."""
    data_world = world // config.sp
    per_step = config.micro_batch_size * data_world
    if global_batch % per_step:
        readers = f"world size {world}" if config.sp == 1 else f"(world size {world} / --sp {config.sp})"
        given = "--global-batch-size" if config.global_batch_size else "the checkpoint's global batch"
        raise SetupError(
            f"{given} {global_batch} is not a multiple of --micro-batch-size {config.micro_batch_size} "
            f"x {readers} = {per_step}"
        )
    return global_batch // per_step


def deepspeed_config(config: TrainConfig, world: int, gas: int) -> dict[str, Any]:
    """DeepSpeed's config: the --deepspeed_config file (checked against the command line) or a default."""
    # DeepSpeed's data-parallel size: ETP is its model-parallel group, SP its sequence-parallel group
    ds_dp = world // (config.etp * config.sp)
    wanted = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "train_batch_size": config.micro_batch_size * gas * ds_dp,
        "gradient_clipping": config.clip_grad,
    }
    if config.deepspeed_config:
        try:
            with open(config.deepspeed_config, encoding="utf-8") as f:
                ds = json.load(f)
        except json.JSONDecodeError as e:
            raise SetupError(
                f"--deepspeed_config {config.deepspeed_config}:{e.lineno}: not valid JSON ({e.msg})"
            ) from e
        for section, instead in (
            ("optimizer", "--lr / --weight-decay"),
            ("scheduler", "--lr / --min-lr / --warmup"),
        ):
            if section in ds:
                raise SetupError(
                    f"--deepspeed_config {config.deepspeed_config}: has a section '{section}'; the trainer builds it "
                    f"from {instead} (remove the section)"
                )
        for key, value in wanted.items():
            if key in ds and ds[key] != "auto" and ds[key] != value:
                raise SetupError(
                    f"--deepspeed_config {config.deepspeed_config}: {key}={ds[key]} contradicts the command line, "
                    f"which gives {key}={value} (--micro-batch-size {config.micro_batch_size}, --global-batch-size "
                    f"{config.global_batch_size or config.micro_batch_size * world}, world size {world}, "
                    f"ETP {config.etp}, --clip-grad {config.clip_grad})"
                )
    else:
        on_gpu = torch.cuda.is_available()
        ds = {
            "zero_optimization": {
                "stage": 2 if on_gpu else 0,
                "contiguous_gradients": True,
                "overlap_comm": on_gpu,
            },
            "bf16": {"enabled": on_gpu},
        }
    ds.update(wanted)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def _or_setup_error(fn: Any, alike: bool = False) -> Any:
    """`fn()`, its OSError / ValueError as a `SetupError`; `alike`: a collective step whose failure every rank
    raises together (reported once)."""
    try:
        return fn()
    except (OSError, ValueError) as e:
        error = SetupError(str(e))
        error.agreed = alike  # type: ignore[attr-defined]
        raise error from e


@dataclass(frozen=True)
class RunPlan:
    """The run-level values, resolved once from the TrainConfig and the world size (before any model is built)."""

    world: int
    global_batch: int  # sequences per optimizer step
    gas: int  # micro-batches per step on each rank
    data_world: int  # sample readers: world / SP (an SP group reads one set of rows)
    ds_config: dict[str, Any]

    @classmethod
    def resolve(cls, config: TrainConfig, world: int, saved_batch: int | None) -> RunPlan:
        """The global batch (given, the --load checkpoint's, or micro x readers), GAS and DeepSpeed's config;
        SetupError naming the option when they do not fit."""
        data_world = world // config.sp
        global_batch = config.global_batch_size or saved_batch or config.micro_batch_size * data_world
        gas = gradient_accumulation(config, world, global_batch)
        return cls(world, global_batch, gas, data_world, deepspeed_config(config, world, gas))

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def bf16(self) -> bool:
        return bool(self.ds_config.get("bf16", {}).get("enabled"))

    def samples_per_step(self, micro_batch_size: int) -> int:
        return micro_batch_size * self.gas * self.data_world


@dataclass(frozen=True)
class _StepReduction:
    """The step's one all-reduce and host read: losses to log (global token means), targets and real tokens."""

    loss: float
    lm_loss: float
    mtp_loss: float
    indexer_loss: float
    target_tokens: int
    real_tokens: int


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.cfg: Glm53Config = model_config(config)
        self._engine: Glm53Engine | None = None
        self.layout: ParallelLayout | None = None
        self.stream: SampleStream | PackedRowStream | None = None
        self.valid: SampleStream | PackedRowStream | None = None  # --valid-data
        self.evaluated: int | None = None  # the step of the last evaluation
        self.last_valid: dict[str, Any] | None = None  # its record
        self.start_step = 0
        self.load_tag: str | None = None  # --load's tag, verified in setup()
        self.base_only = False  # a LoRA run whose --load holds no adapters: its weights are the base
        # a LoRA run's base (`checkpoint/base_weights.py`): recorded by its checkpoints, which then hold the
        # adapters and not the base; None where the base has no source to reload (random initial weights)
        self.base: dict[str, Any] | None = None
        self.weights_dir = config.hf_dir  # released-layout weights the model is built from
        # a native base an adapter checkpoint resumes over
        self.base_checkpoint: tuple[str, str] | None = None
        self._plan: RunPlan | None = None  # set in setup()
        self.consumed = 0  # samples of the run read so far (the data position checkpoints store)
        self.last_saved: str | None = None
        self.last: dict[str, Any] = {}
        self.writer: MetricsWriter | None = None
        self.progress: tqdm | None = None
        self.save_lock: DirectoryLock | None = None
        self.running_step: int | None = None  # the step running (0-based), for a stop's message
        self._skipped_updates = 0  # steps whose global batch held no target tokens
        self.flops: StepFlops | None = None  # the FLOP model of a step (set in setup)
        self.peak_tflops: float | None = None  # the GPU's bf16 peak: --peak-tflops, or known by its name

    def close(self) -> None:
        """Release what the run holds (the --save lock); every exit path."""
        if self.save_lock is not None:
            self.save_lock.release()

    # ------------------------------------------------------------------ set-up
    @property
    def engine(self) -> Glm53Engine:
        """The engine `setup()` built."""
        if self._engine is None:
            raise RuntimeError("Trainer.setup() has not built the engine yet")
        return self._engine

    @property
    def plan(self) -> RunPlan:
        """The run-level values `setup()` resolved."""
        if self._plan is None:
            raise RuntimeError("Trainer.setup() has not resolved the run yet")
        return self._plan

    def setup(self) -> None:
        c, cfg = self.config, self.cfg
        tokenizer = _or_setup_error(lambda: load_tokenizer(c.tokenizer))
        if tokenizer.vocab_size > cfg.vocab_size:
            raise SetupError(
                f"--tokenizer {c.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                f"{cfg.vocab_size}"
            )
        # the layout and batch sizes in the first seconds, before DeepSpeed starts (its op build can take minutes)
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        _or_setup_error(lambda: self._check_layout(world, early=True))
        _or_setup_error(init_distributed)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if c.load:  # the whole tag checked before anything of it is read
            self.load_tag = _or_setup_error(lambda: verify_checkpoint(c.load, c.load_tag), alike=True)
            self.base_only = _or_setup_error(self._lora_against_load, alike=True)
        if c.lora_spec() is not None:
            self._find_base()
        if self.base_checkpoint is not None:  # a native base: checked whole before anything of it is read
            base_dir, base_tag = self.base_checkpoint
            _or_setup_error(lambda: verify_checkpoint(base_dir, base_tag), alike=True)
        saved_batch = self._saved_global_batch()

        # the same inputs on every rank: a failure is every rank's
        _or_setup_error(lambda: self._check_layout(self.world, saved_batch), alike=True)
        # Rank 0 tokenizes (and packs) once; the others wait, then every rank reads the same cache.
        cache_dir = os.path.join(c.output_dir, "data_cache")

        def stream(data: str) -> SampleStream | PackedRowStream:
            return open_stream(data, tokenizer, cache_dir, c.seq_length, c.seed, cfg.vocab_size, c.pack,
                               c.long_documents)  # fmt: skip

        def opened(data: str) -> SampleStream | PackedRowStream:
            """`data`'s stream on every rank: rank 0 builds the cache, the others wait for it, then read it."""
            first = agreed((lambda: stream(data)) if self.rank == 0 else lambda: None)
            later = agreed((lambda: stream(data)) if self.rank != 0 else lambda: None)
            return first if self.rank == 0 else later

        if c.save:  # one writer per checkpoint directory (rank 0 holds the lock for the run)
            lock = self.save_lock = DirectoryLock(c.save, "--save")
            notice = agreed(lambda: lock.acquire() if self.rank == 0 else None)
            if notice:
                print(notice, file=sys.stderr)
        self.stream = opened(c.data)
        if self.rank == 0:
            for notice in self.stream.notices:
                print(notice, file=sys.stderr)
        if c.valid_split:  # a second stream over the same cache, restricted to the held-out samples
            self.valid = stream(c.data)  # the cache exists by now
            _or_setup_error(lambda: hold_out(self.stream, self.valid, c.valid_split), alike=True)
            self._say(self._describe_validation())
        if c.valid_data:
            self.valid = opened(c.valid_data)
            self._say(self._describe_validation())
        if (
            c.load
        ):  # another model config, or another layout without layout-free state: refused before any work
            here = layout_record(self.world, c.ep, c.etp, c.sp, self.plan.zero_stage, self.plan.bf16)
            weights_only = c.load_model_only or self.base_only
            agreed(lambda: check_checkpoint_fits(c.load, str(self.load_tag), cfg, here, weights_only))
            if not weights_only:  # the data a training checkpoint resumes over
                client = _or_setup_error(
                    lambda: read_client_state(str(c.load), str(self.load_tag)), alike=True
                )
                agreed(lambda: self._check_resume_data(client))
            if self.base_checkpoint is not None:
                base_dir, base_tag = self.base_checkpoint
                agreed(lambda: check_checkpoint_fits(base_dir, base_tag, cfg, here, model_only=True))

        self.layout = init_layout(c.ep, c.etp, cfg, sp=c.sp)
        model = agreed(self._build_model)  # a damaged --hf-dir file found by one rank is said once, naming it
        self.flops = step_flops(
            cfg, c.seq_length, mtp=model.mtp is not None, base_trained=c.lora_spec() is None
        )
        on_gpu = torch.cuda.is_available()
        self.peak_tflops = c.peak_tflops or (
            device_peak_tflops(torch.cuda.get_device_name()) if on_gpu else None
        )
        self._engine = build_engine(model, self.plan.ds_config, optimizer=self._adamw, layout=self.layout,
                                   no_decay_pattern=c.no_decay_pattern)  # fmt: skip
        if self.rank == 0:
            print(
                f"optimizer: {describe_param_groups(self.engine, c.weight_decay, c.no_decay_pattern)}",
                file=sys.stderr,
            )
        if self.base_checkpoint is not None:  # an adapter checkpoint's native base, before the adapters
            base_dir, base_tag = self.base_checkpoint
            _or_setup_error(lambda: load_checkpoint(self.engine, base_dir, tag=base_tag, model_only=True,
                                                    keep=is_lora_param, verify=False))  # fmt: skip
        if self.base is not None and c.load and not self.base_only:
            self._say(f"base weights: {describe_base(self.base)}")
        if c.load:
            # over a base checkpoint (no adapters in it) the adapters start fresh
            keep = is_lora_param if self.base_only else None
            client = _or_setup_error(lambda: load_checkpoint(self.engine, c.load, tag=self.load_tag, verify=False,
                                                             model_only=c.load_model_only or self.base_only,
                                                             keep=keep))  # fmt: skip
            self._resume(client)
        if c.gpus is not None and c.gpus != self.world:
            self._say(f"--gpus {c.gpus}: the run was planned for {c.gpus} GPUs and runs on {self.world}")
        if self.rank == 0:
            self._say(
                f"run description: {write_run_file(c, build_parser(), c.output_dir)} (--config replays it)"
            )
            wandb_run = None
            if c.wandb_project:
                wandb_run = WandbRun(c.wandb_project, c.wandb_mode, c.wandb_name, config=_loggable(c))
            self.writer = MetricsWriter(c.output_dir, c.tensorboard_dir, resume_step=self.start_step if c.load else None,
                                        wandb_run=wandb_run)  # fmt: skip
            self.progress = tqdm(total=c.train_iters, initial=self.start_step, desc="train", dynamic_ncols=True,
                                 file=sys.stderr)  # fmt: skip

    def _check_layout(self, world: int, saved_batch: int | None = None, early: bool = False) -> None:
        """The layout (EP x ETP x SP over `world` ranks) and the run plan (batch sizes, DeepSpeed config), each
        refused naming the options. `early`: before DeepSpeed starts, the plan only where no --load's batch is
        still to be read (it is resolved for the run later)."""
        c = self.config
        try:
            validate_layout(world, c.ep, c.etp, self.cfg, sp=c.sp, seq_length=c.seq_length)
            if c.sp > 1 and c.indexer_loss_coef > 0:
                raise ValueError(f"--indexer-loss-coef {c.indexer_loss_coef}: the DSA indexer loss is not "
                                 "supported under sequence parallelism; set it to 0")  # fmt: skip
        except ValueError as e:
            raise SetupError(f"--ep {c.ep} --etp {c.etp} --sp {c.sp}: {e}") from e
        if not early:
            self._plan = RunPlan.resolve(c, world, saved_batch)
        elif not c.load:
            RunPlan.resolve(c, world, None)

    def _saved_global_batch(self) -> int | None:
        """The global batch the --load checkpoint trained with (a training checkpoint resumed whole), which the run
        keeps unless --global-batch-size gives another (announced in one line). Checkpoints saved before it was
        recorded: consumed samples / steps."""
        c = self.config
        if not c.load or c.load_model_only or self.base_only:
            return None
        client = _or_setup_error(lambda: read_client_state(c.load, str(self.load_tag)), alike=True)
        step, consumed = int(client.get("step", 0)), int(client.get("consumed_samples", 0))
        saved = client.get("global_batch_size") or (
            consumed // step if step and consumed % step == 0 else None
        )
        if saved and c.global_batch_size and c.global_batch_size != saved and self.rank == 0:
            print(f"--global-batch-size {c.global_batch_size}: the checkpoint trained with {saved} sequences per "
                  f"step; this run continues with {c.global_batch_size}", file=sys.stderr)  # fmt: skip
        return int(saved) if saved else None

    def _describe_validation(self) -> str:
        assert self.valid is not None
        c, wanted = self.config, self.config.eval_iters * self.plan.global_batch
        when = f"every {c.eval_interval} steps and at the end" if c.eval_interval else "at the end"
        source = (
            f"--valid-data {c.valid_data}" if c.valid_data else f"--valid-split {c.valid_split:g} of --data"
        )
        line = (f"validation: {source}: {self.valid.num_samples} samples; each evaluation "
                f"({when}{', and at the start' if c.eval_at_start else ''}) reads the same {c.eval_iters} x "
                f"{self.plan.global_batch} = {wanted}")  # fmt: skip
        if wanted > self.valid.num_samples:
            line += " (more than it holds: some samples are read twice; lower --eval-iters to avoid it)"
        return line

    def _lora_against_load(self) -> bool:
        """Whether --load gives a LoRA run its base only (a checkpoint without adapters: fresh adapters, optimizer
        state and step 0). A checkpoint holding adapters resumes only with the same ones (rank, alpha, dropout,
        targets): anything else would silently change the experiment, so it is refused, naming both."""
        c = self.config
        mine = lora_record(c.lora_spec())
        held = any(is_lora_param(k) for k in CheckpointDir(c.load or "", str(self.load_tag)).keys())
        if not held:
            return mine is not None
        stored = read_client_state(c.load or "", str(self.load_tag)).get("lora")
        if stored != mine:
            raise SetupError(
                f"--load {c.load}: the checkpoint holds LoRA adapters ({_describe_lora(stored)}); this run asks for "
                f"{_describe_lora(mine)}. Give the same --lora-rank / --lora-alpha / --lora-dropout / --lora-targets "
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

    def _base_source(self) -> tuple[str, str, str | None, dict[str, Any] | None, str] | None:
        """(kind, path, tag, the record to check it against or None, the option that gave it) of a LoRA run's base;
        None where there is none to record (random initial weights) or the checkpoint holds its base too."""
        c = self.config
        ckpt = CheckpointDir(c.load, str(self.load_tag)) if c.load else None
        if ckpt is None or self.base_only:
            if ckpt is not None:
                return NATIVE, str(c.load), self.load_tag, None, f"--load {c.load}"
            return (HF, c.hf_dir, None, None, f"--hf-dir {c.hf_dir}") if c.hf_dir else None
        recorded = read_client_state(str(c.load), str(self.load_tag)).get("base")
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

    def _check_resume_data(self, client: dict[str, Any]) -> None:
        """Before any model is built: a training checkpoint resumes only over the same data (its identity: corpus,
        sample length, seed, the sample range --valid-split leaves to training); anything else would re-read or
        skip samples, or train on held-out ones, so it is refused naming the option."""
        assert self.stream is not None
        c = self.config
        if int(client.get("step", 0)) == 0:
            return
        if "consumed_samples" not in client:
            raise SetupError(f"--load {c.load}: the checkpoint does not record its data position (consumed "
                             "samples); it predates this trainer")  # fmt: skip
        stored = dict(client.get("data", {}))
        if (
            "samples" not in stored
        ):  # written before the range was recorded always: unsplit runs read it whole
            held = self.valid.num_samples if c.valid_split and self.valid is not None else 0
            stored["samples"] = [0, self.stream.num_samples + held]
        if stored["samples"] != self.stream.identity["samples"]:
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

    def _resume(self, client: dict[str, Any]) -> None:
        """Step, data position (consumed samples), RNG from a training checkpoint (its data checked in set-up); a
        converted (model-only) one starts at step 0. A schedule that differs from the checkpoint's is announced."""
        c = self.config
        self.start_step = int(client.get("step", 0))
        where = os.path.join(c.load or "", str(self.load_tag))
        if self.start_step == 0:
            what = "the base weights" if self.base_only else "the weights"
            fresh = "fresh LoRA adapters, " if self.base_only else ""
            self._say(f"loaded {what} of {where} ({fresh}fresh optimizer state, step 0, data from the start)")
            return
        self.consumed = int(client["consumed_samples"])
        if "rng" in client:
            torch.set_rng_state(client["rng"])
        self._say(f"resumed from {where}: step {self.start_step}, {self.consumed} consumed samples, global batch "
                  f"{self.plan.global_batch}")  # fmt: skip
        saved = client.get("schedule")
        if saved and saved != schedule_record(c):
            before = dataclasses.replace(c, **saved).lr_at(self.start_step)
            changed = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {v}" for k, v in schedule_record(c).items()
                                if saved.get(k) != v)  # fmt: skip
            self._say(f"learning-rate schedule: {changed} (the checkpoint's); at step {self.start_step} the "
                      f"learning rate is {c.lr_at(self.start_step):.3g} (it would have been {before:.3g})")  # fmt: skip

    def _build_model(self) -> Glm53Model:
        c, cfg = self.config, self.cfg
        assert self.layout is not None
        dtype = torch.bfloat16 if self.plan.bf16 else torch.float32
        tconfig = make_transformer_config(
            cfg, dtype=dtype, expert_model_parallel_size=c.ep, expert_tensor_parallel_size=c.etp,
            moe_seq_aux_loss_coef=c.aux_loss_coef, indexer_loss_coef=c.indexer_loss_coef,
            loss_chunk_bytes=c.loss_chunk_mib * 2**20, **recompute_overrides(c.recompute),
        )  # fmt: skip
        torch.manual_seed(c.seed)
        use_mtp = cfg.num_nextn_predict_layers > 0
        checkpoint = SafetensorsCheckpoint(self.weights_dir) if self.weights_dir else None
        if checkpoint is not None:  # MTP follows what the weights hold
            use_mtp = use_mtp and checkpoint_has_mtp(checkpoint.keys(), cfg)
        elif self.base_checkpoint is not None:
            use_mtp = use_mtp and CheckpointDir(*self.base_checkpoint).has_mtp
        elif c.load:
            use_mtp = use_mtp and CheckpointDir(c.load, str(self.load_tag)).has_mtp
        model = Glm53Model(tconfig, mtp=use_mtp, pg_collection=self.layout.pg_collection)
        if checkpoint is not None:
            load_hf_state_into(model, checkpoint, mtp=use_mtp)  # each rank reads only its expert shard
        spec = c.lora_spec()
        if spec is not None:  # the same initial adapters on every rank and at every layout
            apply_lora(model, spec, etp_group=self.layout.etp_group if c.etp > 1 else None)
        if spec is not None or c.trainable or c.freeze:
            said = select_trainable(model, spec is not None, c.trainable, c.freeze, c.indexer_loss_coef > 0)
            self._say(said)
        return model

    def _adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """AdamW over build_engine's groups: --weight-decay on matrices, none on biases / 1-D parameters."""
        c = self.config
        return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=c.weight_decay)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> StepMetrics:
        """Step `step` (0-based) over the global batch; returns its metrics."""
        c, engine, plan, layout = self.config, self.engine, self.plan, self.layout
        assert self.stream is not None and layout is not None
        started = time.perf_counter()
        lr = c.lr_at(step)
        engine.set_learning_rate(lr)
        parts: list[LossParts] = []
        # the sample stream this rank reads: every rank of an SP group reads the same rows
        batches = [
            self.stream.micro_batch(
                self.consumed, micro, layout.data_rank, layout.data_world, c.micro_batch_size
            ).to(engine.device)
            for micro in range(plan.gas)
        ]
        normalizers, counts = self._token_normalizers(batches)
        reduced: _StepReduction | None = None
        for micro, batch in enumerate(batches):
            # HF-style labels aligned with the input (the model shifts them); windows carry the token after the
            # window as next_tokens, packed rows their document boundaries
            loss: LossParts = engine(
                batch.input_ids, **batch.model_kwargs(), return_parts=True, token_normalizers=normalizers
            )
            engine.backward(loss.total)
            parts.append(loss)
            if micro == plan.gas - 1:
                reduced = self._reduce_and_check(step, parts, counts)  # before the one update of the step
                if reduced.target_tokens == 0:  # nothing to learn: weight decay alone would move the weights
                    engine.skip_next_update()
                    self._skipped_updates += 1
                    if self._skipped_updates == 1:
                        self._say(f"step {step + 1}: the global batch holds no target tokens; its update is skipped "
                                  "(weights, optimizer state and router bias unchanged; said once, metrics.jsonl "
                                  "marks each such step update_skipped)")  # fmt: skip
            try:
                engine.step()
            except NonFiniteGradientError as e:  # raised on every rank alike, before any parameter changed
                raise TrainingStopped(f"gradient norm is {e.norm} at step {step + 1}; training stopped before "
                                      f"updating the weights. {self.last_good()}") from e  # fmt: skip
        assert reduced is not None
        self.consumed += plan.samples_per_step(c.micro_batch_size)
        skipped = reduced.target_tokens == 0
        balance = update_router_bias(engine.module, rate=0.0 if skipped else c.router_bias_update_rate)
        step_time = time.perf_counter() - started
        norm = engine.get_global_grad_norm()
        tokens = plan.samples_per_step(c.micro_batch_size) * c.seq_length
        assert self.flops is not None
        tflops = self.flops.tflops(tokens / step_time) / self.world  # per GPU (an SP group shares its rows)
        return StepMetrics(
            step=step + 1, consumed_samples=self.consumed, loss=reduced.loss, lm_loss=reduced.lm_loss, lr=lr,
            grad_norm=None if norm is None or skipped else float(norm), tokens_per_s=tokens / step_time, step_time=step_time,
            moe_imbalance=max(balance.values()) if balance else None, target_tokens=reduced.target_tokens,
            packing_efficiency=reduced.real_tokens / tokens if isinstance(self.stream, PackedRowStream) else None,
            mtp_loss=reduced.mtp_loss if engine.module.mtp is not None else None,
            indexer_loss=reduced.indexer_loss if c.indexer_loss_coef > 0 else None,
            update_skipped=True if skipped else None, tokens_per_s_per_gpu=tokens / step_time / self.world,
            tflops_per_gpu=tflops,
            mfu=tflops / self.peak_tflops if self.peak_tflops else None,
        )  # fmt: skip

    def evaluate(self, step: int) -> dict[str, Any]:
        """The validation loss after `step` steps: --eval-iters global batches of --valid-data (the same samples at
        every evaluation and at every layout, read as training reads its batches), the model in eval mode (dropout
        off) without gradients; LM and MTP loss as global token means (`_token_normalizers`, `_reduce`). The
        training data position, the RNG and the router's load counts are left as they were, so a run with
        evaluation trains exactly as one without. Logged as a metrics.jsonl record (`valid_*`) and one line."""
        c, plan, layout = self.config, self.plan, self.layout
        assert self.valid is not None and layout is not None
        model = self.engine.module
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        model.eval()
        try:
            with torch.no_grad():
                batches = [self.valid.micro_batch(k * plan.global_batch, micro, layout.data_rank, layout.data_world,
                                                  c.micro_batch_size).to(self.engine.device)
                           for k in range(c.eval_iters) for micro in range(plan.gas)]  # fmt: skip
                normalizers, counts = self._token_normalizers(batches)
                parts = [model(b.input_ids, **b.model_kwargs(), return_parts=True, token_normalizers=normalizers)
                         for b in batches]  # fmt: skip
                _, reduced = self._reduce(parts, counts)
        finally:
            model.train()
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        record: dict[str, Any] = {"step": step, "valid_lm_loss": reduced.lm_loss}
        line = f"validation at step {step}: lm_loss {reduced.lm_loss:.4f}"
        if model.mtp is not None:
            record["valid_mtp_loss"] = reduced.mtp_loss
            line += f", mtp_loss {reduced.mtp_loss:.4f}"
        record["valid_target_tokens"] = reduced.target_tokens
        self._say(f"{line} ({reduced.target_tokens} target tokens)")
        if self.writer is not None:
            self.writer.write(record)
        self.evaluated, self.last_valid = step, record
        return record

    def _token_normalizers(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per loss (LM, each MTP depth): the global batch's target count / (micro-batches x data ranks). Each
        micro-batch's loss is its token sum divided by it, so the micro-batch losses, averaged by DeepSpeed over
        accumulation steps and data ranks (summed over SP ranks), are the token mean over the whole global batch
        (docs/numerics.md). Under SP each rank counts its own shard's targets. One all-reduce, no host sync.
        Returns (the normalizers, the global batch's LM targets and real tokens, read at the step's one sync)."""
        model = self.engine.module
        layout = self.layout
        assert layout is not None
        counts = torch.stack([model.count_targets(**b.model_kwargs()) for b in batches]).sum(0)
        real_here = sum(b.real_tokens for b in batches) if layout.sp_rank == 0 else 0  # once per SP group
        real = torch.tensor([real_here], device=counts.device, dtype=counts.dtype)
        totals = torch.cat([counts, real])
        if self.world > 1:
            dist.all_reduce(totals)
        return totals[:-1].double() / (len(batches) * self.plan.data_world), totals[[0, -1]]

    def _reduce_and_check(self, step: int, parts: list[LossParts], counts: torch.Tensor) -> _StepReduction:
        """One all-reduce and one host sync per step: which micro-batches were not finite anywhere, and the
        losses to log (means over micro-batches and data ranks, sums over SP ranks: the global token mean)."""
        bad, reduced = self._reduce(parts, counts)
        if bad:
            raise TrainingStopped(
                f"loss is {reduced.loss} at step {step + 1} (micro-batch {bad[0]}); training stopped before "
                f"updating the weights. {self.last_good()}"
            )
        return reduced

    def _reduce(self, parts: list[LossParts], counts: torch.Tensor) -> tuple[list[int], _StepReduction]:
        """(the micro-batches not finite on some rank, the global token means) of micro-batch losses made with
        `_token_normalizers`' normalizers: one all-reduce, one host read."""
        flags = torch.stack([(~torch.isfinite(p.total.detach())).float() for p in parts])
        zero = torch.zeros((), device=flags.device)

        def row(p: LossParts) -> torch.Tensor:  # total, lm, mtp, indexer
            optional = [zero if t is None else t.detach() for t in (p.mtp, p.indexer)]
            return torch.stack([p.total.detach(), p.lm.detach(), *optional])

        per_micro = torch.stack([row(p) for p in parts]).float()  # [micro, 4]
        sums = per_micro.sum(0) / (len(parts) * self.plan.data_world)
        packed = torch.cat([flags, sums]).double()
        if self.world > 1:
            dist.all_reduce(packed)
        values = torch.cat([packed, counts.double()]).tolist()  # the one host sync
        flags_out, (total, lm, mtp, indexer), (targets, real) = (
            values[: len(parts)], values[len(parts) : -2], values[-2:]
        )  # fmt: skip
        bad = [i for i, f in enumerate(flags_out) if f > 0]
        return bad, _StepReduction(total, lm, mtp, indexer, int(targets), int(real))

    def last_good(self) -> str:
        """Where a stopped run can be resumed from: the last checkpoint it saved, or what it started from."""
        if self.last_saved:
            return f"The last checkpoint this run saved is {self.last_saved}"
        if self.config.load:
            return f"This run saved no checkpoint; it started from {self.config.load}"
        return "No checkpoint was saved" + ("" if self.config.save else " (--save not given)")

    # ------------------------------------------------------------------ checkpoints and the end
    def save(self, step: int) -> None:
        assert self.layout is not None and self.stream is not None and self.config.save
        check_replicas(self.engine.module, self.layout)
        client = {"step": step, "consumed_samples": self.consumed, "global_batch_size": self.plan.global_batch,
                  "data": self.stream.identity, "rng": torch.get_rng_state(), "schedule": schedule_record(self.config),
                  "lora": lora_record(self.config.lora_spec()), "base": self.base}  # fmt: skip
        adapters_only = self.base is not None and self.config.lora_spec() is not None
        try:
            self.last_saved = save_checkpoint(self.engine, self.config.save, f"step{step}", client_state=client,
                                              adapters_only=adapters_only)  # fmt: skip
        except CheckpointError as e:  # non-finite weights: decided on every rank alike
            raise TrainingStopped(f"{e}. {self.last_good()}") from e
        except DiskFull as e:  # found by the ranks whose writes failed, not by all
            stopped = TrainingStopped(f"{e}. {self.last_good()}")
            stopped.agreed = False  # type: ignore[attr-defined]
            raise stopped from e
        self._say(f"saved {self.last_saved} (step {step}, {self.consumed} consumed samples)")

    def _say(self, line: str) -> None:
        """One line of what the run did (rank 0), under the progress bar."""
        if self.rank == 0:
            tqdm.write(line, file=sys.stderr)

    def _log(self, record: dict[str, Any]) -> None:
        self.last = record
        if self.writer is not None:
            self.writer.write(record)
        if self.progress is not None:
            self.progress.update(1)
            shown = {"lm_loss": f"{record['lm_loss']:.3f}", "lr": f"{record['lr']:.2e}"}
            if self.last_valid is not None:  # the latest validation loss beside the training one
                shown["valid_lm_loss"] = f"{self.last_valid['valid_lm_loss']:.3f}"
            self.progress.set_postfix(**shown)
            if self.config.log_interval and record["step"] % self.config.log_interval == 0:
                self.progress.write(format_record(record))

    def finish(self) -> None:
        c = self.config
        if self.valid is not None and self.evaluated != c.train_iters:
            self.evaluate(c.train_iters)
        if (
            c.save
            and (not c.save_interval or c.train_iters % c.save_interval)
            and self.start_step < c.train_iters
        ):
            self.save(c.train_iters)
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
            if os.path.getsize(self.writer.path):
                plot_loss(self.writer.path, os.path.join(c.output_dir, "loss.png"))
        if c.export_hf:
            export_engine_to_hf(self.engine, self.cfg, c.export_hf, template=c.hf_dir, force=c.force,
                                tokenizer=c.tokenizer)  # fmt: skip
            self._say(f"exported {c.export_hf} (transformers layout, step {c.train_iters})")
        if c.export_adapter:
            notices = _or_setup_error(lambda: export_engine_to_peft(self.engine, str(c.export_adapter), force=c.force),
                                      alike=True)  # fmt: skip
            for notice in notices:
                self._say(f"--export-adapter: {notice}")
            self._say(f"exported {c.export_adapter} (PEFT LoRA adapter of transformers' glm5_next, step "
                      f"{c.train_iters})")  # fmt: skip

    def run(self) -> dict[str, Any]:
        self.setup()
        c = self.config
        assert self.layout is not None
        if self.valid is not None and c.eval_at_start:
            self.evaluate(self.start_step)
        for step in range(self.start_step, c.train_iters):
            self.running_step = step
            self._log(self.train_step(step).as_record())
            if self.valid is not None and c.eval_interval and (step + 1) % c.eval_interval == 0:
                self.evaluate(step + 1)
            if c.check_replicas_interval and (step + 1) % c.check_replicas_interval == 0:
                check_replicas(self.engine.module, self.layout)
            if c.save and c.save_interval and (step + 1) % c.save_interval == 0:
                self.save(step + 1)
        self.finish()
        return self.last


def format_record(record: dict[str, Any]) -> str:
    """A metrics record as a log line, under the names metrics.jsonl and TensorBoard use (`loss` is the total that
    is trained: lm_loss + mtp_loss_weight x mtp_loss (+ auxiliary losses))."""
    parts = [f"step {record['step']}", f"lm_loss {record['lm_loss']:.4f}"]
    if "mtp_loss" in record:
        parts.append(f"mtp_loss {record['mtp_loss']:.4f}")
    parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    per_gpu = record.get("tokens_per_s_per_gpu")
    parts.append(
        f"{record['tokens_per_s']:.0f} tok/s" + (f" ({per_gpu:.0f}/GPU)" if per_gpu is not None else "")
    )
    if record.get("tflops_per_gpu") is not None:
        parts.append(f"{record['tflops_per_gpu']:.3g} TFLOP/s/GPU")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.1%}")
    if record.get("moe_imbalance") is not None:
        parts.append(f"moe_imbalance {record['moe_imbalance']:.2f}")
    return " | ".join(parts)


def report_error(error: Exception, lead: str = "") -> None:
    """One `error:` line per failure, not one per rank: a failure every rank finds alike (before the process group
    exists: every rank of a node reads the same files; after it: `agreed` steps and training stops) is printed by
    rank 0 (local rank 0 before the group exists); one that a rank found alone is printed by it, naming it."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        alike = getattr(error, "agreed", isinstance(error, TrainingStopped))
    else:
        rank, world, alike = int(os.environ.get("LOCAL_RANK", "0")), 1, True
    if not alike or rank == 0:
        where = f"rank {rank}: " if not alike and world > 1 else ""
        print(f"{lead}error: {where}{error}", file=sys.stderr, flush=True)
    if (
        alike and world > 1
    ):  # no rank leaves before rank 0 has said it (the launcher kills the rest at the first exit)
        dist.barrier()
    elif alike and rank != 0:  # before the process group: local rank 0 says it; a moment for it to
        time.sleep(2)


def _report_stop(signum: int, trainer: Trainer | None) -> None:
    """A stop signal's one line (rank 0): where the run stopped and what survived; then the --save lock goes."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
    if rank == 0:
        at = (
            f" at step {trainer.running_step + 1}"
            if trainer is not None and trainer.running_step is not None
            else ""
        )
        survived = trainer.last_good() if trainer is not None else "Nothing was written yet"
        released = (
            "; the --save lock is released" if trainer is not None and trainer.save_lock is not None else ""
        )
        print(
            f"\nerror: stopped by {signal_name(signum)}{at}{released}. {survived}",
            file=sys.stderr,
            flush=True,
        )
    if trainer is not None:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    trainer: Trainer | None = None
    stop = StopSignals(lambda signum: _report_stop(signum, trainer)).install()
    try:
        args, overrides = parse_with_config(parser, sys.argv[1:] if argv is None else list(argv))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            for line in overrides:
                print(line, file=sys.stderr)
        trainer = Trainer(TrainConfig.from_args(args))
        last = trainer.run()
        if dist.is_initialized() and dist.get_rank() == 0 and last:
            print("final: " + format_record(last))
        return 0
    except SetupError as e:
        stop.quiet()
        report_error(e)
        return 2
    except TrainingStopped as e:
        stop.quiet()
        report_error(e, lead="\n")  # after the progress bar's line
        return 3
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Interrupted`)
        return stop.code_of(e)
    except Exception:  # a collective broken by a peer that stopped first: still the signal's stop
        if stop.received is None:
            raise
        return stop.code_of(Interrupted())
    finally:  # every rank reaches here together: refusals and stops are decided on all ranks alike
        stop.uninstall()
        if trainer is not None:
            trainer.close()
        close_distributed()


def _loggable(config: TrainConfig) -> dict[str, Any]:
    """The run's options as a W&B run configuration (plain values)."""
    return {
        k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, str | int | float | bool | None)
    }


def schedule_record(config: TrainConfig) -> dict[str, Any]:
    """What fixes the learning rate at each step (`TrainConfig.lr_at`), recorded by checkpoints."""
    return {k: getattr(config, k) for k in ("lr", "min_lr", "warmup", "train_iters")}


def lora_record(spec: LoraSpec | None) -> dict[str, Any] | None:
    """What a checkpoint records of a run's LoRA adapters, None without."""
    return None if spec is None else spec.record()


def _describe_lora(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no LoRA adapters"
    return (f"rank {record['rank']}, alpha {record['alpha']:g}, dropout {record['dropout']:g}, targets "
            f"{','.join(record['targets'])}")  # fmt: skip
