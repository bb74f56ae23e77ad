"""One optimizer step over the global batch, and an evaluation: the `Trainer`'s step half (trainer.py).

A step runs its micro-batches (gradient accumulation), normalises the loss by the global batch's target tokens
(`_token_normalizers`), and makes one all-reduce and one host read of what it logs and checks (`_reduce`): a
non-finite loss or gradient stops the run before the update (`TrainingStopped`); a global batch without targets
skips its update (`Glm53Engine.skip_next_update`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..engine import Glm53Engine, NonFiniteGradientError
from ..flops import StepFlops
from ..layers.moe import update_router_bias
from ..model import LossParts
from ..parallel.layout import ParallelLayout
from .config import TrainConfig
from .metrics import MetricsWriter, StepMetrics
from .packing import Batch
from .run_plan import RunPlan
from .run_report import RunReport

if TYPE_CHECKING:
    from .data import DataStream


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (a non-finite loss or gradient): decided on every rank alike."""

    # reported once (run_plan.report_error); False where one rank alone found it (its disk full)
    agreed = True


@dataclass(frozen=True)
class _StepReduction:
    """The step's one all-reduce and host read: losses to log (global token means), targets and real tokens."""

    loss: float
    lm_loss: float
    mtp_loss: float
    indexer_loss: float
    target_tokens: int
    real_tokens: int


class TrainSteps:
    """The `Trainer`'s step and evaluation (the attributes below are the Trainer's)."""

    config: TrainConfig
    world: int
    layout: ParallelLayout | None
    stream: DataStream | None
    valid: DataStream | None
    consumed: int
    flops: StepFlops | None
    peak_tflops: float | None
    _skipped_updates: int
    writer: MetricsWriter | None
    evaluated: int | None
    last_valid: dict[str, Any] | None
    report: RunReport

    @property
    def engine(self) -> Glm53Engine:
        raise NotImplementedError

    @property
    def plan(self) -> RunPlan:
        raise NotImplementedError

    def _say(self, line: str) -> None:
        raise NotImplementedError

    def last_good(self) -> str:
        raise NotImplementedError

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
            packing_efficiency=reduced.real_tokens / tokens if self.stream.packed else None,
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
        self.report.evaluated(record)
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
