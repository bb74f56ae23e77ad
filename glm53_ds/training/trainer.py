"""`Trainer`: the training loop behind `deepspeed launch/train.py`, driven by a `TrainConfig`.

    setup()        everything that can be wrong is checked before the model is built (data, tokenizer,
                   checkpoint dirs, layout, batch sizes vs the DeepSpeed config, token ids vs vocab); then the
                   layout's process groups, the model with this rank's experts (from --hf-dir: only its
                   tensors), `glm53_ds.build_engine`, and --load
    train_step(s)  one optimizer step over the global batch; one host sync for the NaN check and the logged loss
                   (step.py: `TrainSteps`)
    save(s)        replica check + checkpoint (engine/checkpoint.py)
    finish()       final save, loss curve, --export-hf, --export-adapter
`run()` does all of it; training/main.py's `main()` maps failures to exit codes (2: set-up, 3: training stopped). The run-level values
(global batch, accumulation, DeepSpeed config) are run_plan.py's `RunPlan`; what --load and a LoRA base give is
resume.py's `ResumeChecks`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..checkpoint import CheckpointDir, CheckpointError, layout_record, verify_checkpoint
from ..checkpoint.base_weights import describe_base
from ..checkpoint.directory import later_tags
from ..compile import apply_compile
from ..config import Glm53Config
from ..data.columns import parse_column_map
from ..data.prepare import default_workers
from ..engine import (
    Glm53Engine,
    build_engine,
    check_checkpoint_fits,
    describe_param_groups,
    export_engine_to_hf,
    export_engine_to_peft,
    init_distributed,
    load_checkpoint,
    save_checkpoint,
)
from ..flops import StepFlops, device_peak_tflops, step_flops
from ..hf_loader import SafetensorsCheckpoint, checkpoint_has_mtp, load_hf_state_into
from ..model import Glm53Model
from ..parallel.layout import ParallelLayout, init_layout, validate_layout
from ..parallel.rank_order import node_of_ranks, placement_line, rank_hosts
from ..parallel.replicas import check_replicas
from ..safe_io import DirectoryLock, DiskFull
from ..transformer_config import make_transformer_config
from .args import build_parser
from .base_quant import BaseQuant
from .config import SetupError, TrainConfig
from .data import Building, DataStream, is_chat_source, load_tokenizer, open_stream
from .epochs import epoch_steps, validation_line
from .metrics import MetricsWriter, WandbRun, loggable, plot_loss
from .mixture import DataSource, MixedStream, parse_sources, split_validation
from .model_converters import adapters_of, apply_converters, model_converters
from .output_dir import claim_output_dir, writer_locks
from .peers import Heartbeat
from .resume import ResumeChecks, schedule_record
from .run_file import write_run_file
from .run_plan import RunPlan, agreed, model_config, or_setup_error
from .run_report import RunReport, kernels_line
from .samples import Prompt, fit_prompts, generate_samples, read_prompts
from .shared_storage import check_shared_storage
from .state import TrainingState, prune_checkpoints
from .step import TrainingStopped, TrainSteps

__all__ = ["SetupError", "Trainer", "TrainingStopped"]


class Trainer(ResumeChecks, TrainSteps):
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.cfg: Glm53Config = model_config(config)
        # what changes the built model (LoRA adapters, the trainable set), and the adapters among them
        self.converters = model_converters(config.lora_spec(), config.trainable, config.freeze,
                                           config.indexer_loss_coef > 0)  # fmt: skip
        self.adapters = adapters_of(self.converters)
        self._engine: Glm53Engine | None = None
        self.layout: ParallelLayout | None = None
        self.stream: DataStream | None = None
        self.valid: DataStream | None = None  # --valid-data
        self.evaluated: int | None = None  # the step of the last evaluation
        self.prompts: list[Prompt] | None = None  # --sample-prompts, read at set-up
        self.sampled: int | None = None  # the step of the last samples
        self.tokenizer: Any = None
        self.last_valid: dict[str, Any] | None = None  # its record
        self.start_step = 0
        self.resumed_run: str | None = None  # the run id its --load checkpoint records (a resume)
        self.run_id: str | None = None  # rank 0's (output_dir.py), recorded by its checkpoints
        self.load_tag: str | None = None  # --load's tag, verified in setup()
        self.base_only = False  # a LoRA run whose --load holds no adapters: its weights are the base
        # a LoRA run's base (`checkpoint/base_weights.py`): recorded by its checkpoints, which then hold the
        # adapters and not the base; None where the base has no source to reload (random initial weights)
        self.base: dict[str, Any] | None = None
        self.weights_dir = config.hf_dir  # released-layout weights the model is built from
        # a native base an adapter checkpoint resumes over
        self.base_checkpoint: tuple[str, str] | None = None
        self.base_quant = BaseQuant()  # --base-quant, resolved in setup()
        self._plan: RunPlan | None = None  # set in setup()
        self.consumed = 0  # samples of the run read so far (the data position checkpoints store)
        self.last_saved: str | None = None
        self.last: dict[str, Any] = {}
        self.writer: MetricsWriter | None = None
        self.progress: tqdm | None = None
        self.locks: list[DirectoryLock] = []  # --save's and --output-dir's writer locks (rank 0 holds them)
        self.running_step: int | None = None  # the step running (0-based), for a stop's message
        self._skipped_updates = 0  # steps whose global batch held no target tokens
        self.flops: StepFlops | None = None  # the FLOP model of a step (set in setup)
        self.peak_tflops: float | None = None  # the GPU's bf16 peak: --peak-tflops, or known by its name
        self.report = RunReport()  # the periodic lines' interval throughput, the end-of-run summary
        self.heartbeat: Heartbeat | None = (
            None  # names the ranks a failed collective lost (training/peers.py)
        )

    def close(self) -> None:
        """Release what the run holds (the engine, the --save and --output-dir locks); every exit path."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for lock in self.locks:
            lock.release()

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
        tokenizer = self.tokenizer = or_setup_error(lambda: load_tokenizer(c.tokenizer))
        if tokenizer.vocab_size > cfg.vocab_size:
            raise SetupError(
                f"--tokenizer {c.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                f"{cfg.vocab_size}"
            )
        sources = parse_sources(c.data)  # checked with the options (training/option_checks.py)
        columns = or_setup_error(lambda: parse_column_map(c.data_columns or (), [s.path for s in sources]))
        cache_dir = c.data_cache or os.path.join(c.output_dir, "data_cache")
        if c.sample_prompts:  # read now: a bad line is said before any expensive work
            chat = or_setup_error(lambda: any(is_chat_source(s.path, columns, cache_dir) for s in sources))
            prompts = or_setup_error(lambda: read_prompts(str(c.sample_prompts), tokenizer, chat))
            self.prompts, notice = fit_prompts(prompts, cfg.max_position_embeddings, c.sample_tokens)
            if notice and int(os.environ.get("LOCAL_RANK", "0")) == 0:
                print(notice, file=sys.stderr)
        # the layout and batch sizes in the first seconds, before DeepSpeed starts (its op build can take minutes)
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        or_setup_error(lambda: self._check_layout(world, early=True))
        or_setup_error(lambda: init_distributed(c.dist_timeout))
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.heartbeat = Heartbeat.start_default()  # collective: every rank's host
        if c.load:  # the whole tag checked before anything of it is read
            self.load_tag = or_setup_error(lambda: verify_checkpoint(c.load, c.load_tag), alike=True)
            self.base_only = or_setup_error(self._adapters_against_load, alike=True)
        if self.adapters is not None:
            self._find_base()
        self._resolve_base_quant()  # before any expensive work: its refusals
        if self.base_checkpoint is not None:  # a native base: checked whole before anything of it is read
            base_dir, base_tag = self.base_checkpoint
            or_setup_error(lambda: verify_checkpoint(base_dir, base_tag), alike=True)
        saved_batch = self._saved_global_batch()

        # the same inputs on every rank: a failure is every rank's
        or_setup_error(lambda: self._check_layout(self.world, saved_batch), alike=True)
        # Each node's local rank 0 tokenizes (and packs) with --data-workers processes, once per file system (a
        # lock: on shared storage one builds, the others wait); every rank waits on that lock, then maps the cache.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        building = Building(
            c.data_workers or default_workers(), builder=local_rank == 0, progress=local_rank == 0
        )

        def stream(data: Sequence[DataSource], option: str = "--data") -> DataStream:
            return open_stream(data, tokenizer, cache_dir, c.seq_length, c.seed, cfg.vocab_size, c.pack,
                               c.long_documents, columns, building, option)  # fmt: skip

        def opened(data: Sequence[DataSource], option: str = "--data") -> DataStream:
            """`data`'s stream on every rank, its failure said once."""
            return agreed(lambda: stream(data, option))

        # one writer per checkpoint directory and per output directory (rank 0 holds the locks for the run): a
        # second run into either is refused before it writes there (one lock where the two are one directory)
        for lock in writer_locks(c.save, c.output_dir):
            self.locks.append(lock)
            notice = agreed(lambda lock=lock: lock.acquire() if self.rank == 0 else None)
            if notice:
                print(notice, file=sys.stderr)
        shared = [("--save", c.save), ("--output-dir", c.output_dir), ("--data-cache", cache_dir)]
        or_setup_error(lambda: check_shared_storage([(o, d) for o, d in shared if d],
                                                    [("--hf-dir", c.hf_dir)] if c.hf_dir else []), alike=True)  # fmt: skip
        self.stream = opened(sources)
        if self.rank == 0:
            for notice in self.stream.notices:
                print(notice, file=sys.stderr)
        if c.valid_split:  # a second stream over the same cache, restricted to the held-out samples
            self.valid = stream(sources)  # the caches exist by now
            or_setup_error(lambda: split_validation(self.stream, self.valid, c.valid_split), alike=True)
            self._say(self._describe_validation())
        if c.valid_data:
            self.valid = opened(parse_sources([c.valid_data], "--valid-data")[:1], "--valid-data")
            self._say(self._describe_validation())
        if isinstance(
            self.stream, MixedStream
        ):  # what was mixed, and what each source gives (held-out ones excluded)
            self._say(self.stream.describe())
        self._say(self._describe_epochs())
        c = self.config  # --train-epochs has set the steps
        if (
            c.load
        ):  # another model config, or another layout without layout-free state: refused before any work
            here = layout_record(self.world, c.ep, c.etp, c.sp, self.plan.zero_stage, self.plan.bf16)
            weights_only = c.load_model_only or self.base_only
            agreed(lambda: check_checkpoint_fits(c.load, str(self.load_tag), cfg, here, weights_only))
            if not weights_only:  # the data a training checkpoint resumes over
                saved = self.saved_state()
                agreed(lambda: self._check_resume_data(saved))
            if self.base_checkpoint is not None:
                base_dir, base_tag = self.base_checkpoint
                agreed(lambda: check_checkpoint_fits(base_dir, base_tag, cfg, here, model_only=True))

        self.layout = init_layout(c.ep, c.etp, cfg, sp=c.sp, timeout=timedelta(seconds=c.dist_timeout))
        nodes = node_of_ranks(rank_hosts()) if self.world > 1 else [0]
        if len(set(nodes)) > 1:  # which groups cross nodes (parallel/rank_order.py)
            self._say(placement_line(nodes, c.ep, c.etp, c.sp))
        model = agreed(self._build_model)  # a damaged --hf-dir file found by one rank is said once, naming it
        self._say(kernels_line(model, torch.device("cuda" if torch.cuda.is_available() else "cpu")))
        self.flops = step_flops(
            cfg, c.seq_length, mtp=model.mtp is not None, base_trained=self.adapters is None
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
        if c.offload_optimizer == "cpu" and self.adapters is not None:
            state = 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)
            self._say(f"--offload-optimizer cpu with LoRA: the adapters' optimizer state is {state / 2**20:,.1f} MiB "
                      "per rank, and the host update and its copies cost time every step: rarely worth it")  # fmt: skip
        if self.base_checkpoint is not None:  # an adapter checkpoint's native base, before the adapters
            assert self.adapters is not None
            base_dir, base_tag, adds = *self.base_checkpoint, self.adapters.adds
            or_setup_error(lambda: load_checkpoint(self.engine, base_dir, tag=base_tag, model_only=True,
                                                    keep=adds, verify=False))  # fmt: skip
        if self.base is not None and c.load and not self.base_only:
            self._say(f"base weights: {describe_base(self.base)}")
        if c.load:
            # over a base checkpoint (no adapters in it) the adapters start fresh
            keep = self.adapters.adds if self.base_only and self.adapters is not None else None
            weights_only = c.load_model_only or self.base_only
            or_setup_error(lambda: load_checkpoint(self.engine, c.load, tag=self.load_tag, verify=False,
                                                    model_only=weights_only, keep=keep))  # fmt: skip
            self._resume(TrainingState() if weights_only else self.saved_state())
        if c.gpus is not None and c.gpus != self.world:
            self._say(f"--gpus {c.gpus}: the run was planned for {c.gpus} GPUs and runs on {self.world}")
        if self.rank == 0:
            # a resume from a tag with later ones beside it is a branch: a new run, the first one's outputs kept
            branch = self.start_step > 0 and bool(c.load and later_tags(c.load, str(self.load_tag)))
            self.run_id, moved = claim_output_dir(
                c.output_dir, self.resumed_run, resuming=self.start_step > 0 and not branch
            )
            if moved:
                self._say(moved)
            ran = dataclasses.replace(
                c, gpus=self.world
            )  # the world it ran at: the planner's --config plans it
            self._say(
                f"run description: {write_run_file(ran, build_parser(), c.output_dir)} (--config replays it)"
            )
            wandb_run = None
            if c.wandb_project:
                wandb_run = WandbRun(c.wandb_project, c.wandb_mode, c.wandb_name, config=loggable(c))
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
        except ValueError as e:
            raise SetupError(f"--ep {c.ep} --etp {c.etp} --sp {c.sp}: {e}") from e
        if not early:
            self._plan = RunPlan.resolve(c, world, saved_batch)
        elif not c.load:
            RunPlan.resolve(c, world, None)

    def _describe_epochs(self) -> str:
        """The data's start-up line; under --train-epochs the run's steps, set here (the schedule with them) before
        anything reads --train-iters, counted in samples consumed past a resume (epochs.py)."""
        assert self.stream is not None
        c, step, consumed = self.config, 0, 0
        if c.load and c.train_epochs is not None and not (c.load_model_only or self.base_only):
            step, consumed = self.saved_state().step, self.saved_state().consumed_samples
        steps, line = epoch_steps(c, self.stream.num_samples, self.plan.global_batch, step, consumed)
        self.config = dataclasses.replace(c, train_iters=steps)
        return line

    def _describe_validation(self) -> str:
        assert self.valid is not None
        return validation_line(self.config, self.valid.num_samples, self.plan.global_batch)

    def _build_model(self) -> Glm53Model:
        c, cfg = self.config, self.cfg
        assert self.layout is not None
        dtype = torch.bfloat16 if self.plan.bf16 else torch.float32
        tconfig = make_transformer_config(
            cfg, dtype=dtype, **c.transformer_overrides(), **self.base_quant.transformer_fields()
        )
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
        for said in apply_converters(model, self.converters, self.layout.etp_group if c.etp > 1 else None):
            self._say(said)
        if c.compile:  # last, as torchtitan: over the adapters and the trainable set
            regions = apply_compile(model, backend=c.compile_backend)
            self._say(f"--compile: {len(regions)} regions ({c.compile_backend}: the decoder layers, the MTP layer, "
                      "the loss head); the first step compiles them")  # fmt: skip
        return model

    def _adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """AdamW over build_engine's groups: --weight-decay on matrices, none on biases / 1-D parameters."""
        c = self.config
        return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=c.weight_decay)

    # ------------------------------------------------------------------ one step

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
        state = TrainingState(step, self.consumed, self.plan.global_batch, dict(self.stream.identity),
                              torch.get_rng_state(), schedule_record(self.config), self.adapters.record if self.adapters else None,
                              self.base, self.run_id)  # fmt: skip
        adapters_only = self.base is not None and self.adapters is not None
        try:
            self.last_saved = save_checkpoint(self.engine, self.config.save, f"step{step}", client_state=state.client_state(),
                                              adapters_only=adapters_only)  # fmt: skip
        except CheckpointError as e:  # non-finite weights: decided on every rank alike
            raise TrainingStopped(f"{e}. {self.last_good()}") from e
        except DiskFull as e:  # found by the ranks whose writes failed, not by all
            stopped = TrainingStopped(f"{e}. {self.last_good()}")
            stopped.agreed = False
            raise stopped from e
        self._say(f"saved {self.last_saved} (step {step}, {self.consumed} consumed samples)")
        if self.config.keep_last and self.rank == 0 and self.run_id:
            removed = prune_checkpoints(self.config.save, self.config.keep_last, self.run_id)
            if removed:
                self._say(
                    f"--keep-last {self.config.keep_last}: removed {', '.join(removed)} (this run's older tags)"
                )

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
        line = self.report.step(record, self.config.log_interval)
        if line is not None and self.progress is not None:
            self.progress.write(line)

    def sample(self, step: int) -> None:
        """--sample-prompts' completions after `step` steps (every rank generates: the dispatch is collective; rank
        0 writes them and says the first in one line). The training is left as it was (training/samples.py)."""
        assert self.prompts is not None
        c = self.config
        self.sampled = step
        try:  # samples never cost the run: a failure is one line, the training and its saves go on
            samples = generate_samples(self.engine.module, self.prompts, self.tokenizer, c.sample_tokens,
                                       self.engine.device, self.cfg.max_position_embeddings)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            self._say(
                f"samples at step {step} failed ({type(e).__name__}: {e}); the run goes on without them"
            )
            return
        if self.writer is not None:
            self.writer.write_samples(step, samples)
            first = samples[0]["completion"].replace("\n", " ")
            self._say(f"samples at step {step} ({len(samples)}, {os.path.join(c.output_dir, 'samples.jsonl')}): "
                      f"{samples[0]['prompt'][:40]!r} -> {first[:60]!r}")  # fmt: skip

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
        if (
            self.prompts is not None and self.sampled != c.train_iters
        ):  # after the save: samples never cost it
            self.sample(c.train_iters)
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
            if os.path.getsize(self.writer.path):
                plot_loss(self.writer.path, os.path.join(c.output_dir, "loss.png"))
        exports: list[str] = []  # what the end summary names, each with what it holds
        if c.export_hf:
            fp8_like = self.weights_dir if c.export_format == "fp8" else None
            requantised = export_engine_to_hf(self.engine, self.cfg, c.export_hf, template=c.hf_dir, force=c.force,
                                              tokenizer=c.tokenizer, fp8_like=fp8_like)  # fmt: skip
            weights = f"block-FP8 as released, {requantised}" if requantised else (
                ("bf16" if self.plan.bf16 else "fp32") + ", dense" + (", LoRA merged" if c.lora_rank else ""))  # fmt: skip
            self._say(f"exported {c.export_hf} (transformers layout, {weights}, step {c.train_iters})")
            exports.append(f"{c.export_hf} ({weights})")
        if c.export_adapter:
            notices = or_setup_error(lambda: export_engine_to_peft(self.engine, str(c.export_adapter), force=c.force),
                                      alike=True)  # fmt: skip
            for notice in notices:
                self._say(f"--export-adapter: {notice}")
            self._say(f"exported {c.export_adapter} (PEFT LoRA adapter of transformers' glm5_next, step "
                      f"{c.train_iters})")  # fmt: skip
        exports += [c.export_adapter] if c.export_adapter else []
        self._say(self.report.summary(c.output_dir, self.last_saved, exports, plot=self.writer is not None))

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
            if self.prompts is not None and c.sample_interval and (step + 1) % c.sample_interval == 0:
                self.sample(step + 1)
        self.finish()
        return self.last
