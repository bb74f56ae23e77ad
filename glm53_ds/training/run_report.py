"""What a run says about itself (rank 0): the kernels it resolved, the periodic lines' throughput over their
interval (not one step's), and the end-of-run summary (wall time, tokens, mean throughput and MFU, the best
validation loss, the last checkpoint, the exports, where the metrics went)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import backends
from ..layers.moe.experts import GroupedExperts
from .metrics import StepMetrics, format_record

# the timing fields but the step time itself: each proportional to 1 / step time
RATES = tuple(key for key in StepMetrics.TIMING if key != "step_time")


def kernels_line(model: nn.Module, device: torch.device) -> str:
    """The backends the model runs with on `device`, as resolved (`auto` said as what it means there)."""
    config: Any = model.config
    parts = [f"{label} {backends.resolve(name, getattr(config, name), device)}"
             for label, name in (("attention", backends.ATTENTION), ("KDA", backends.KDA),
                                 ("mHC post", backends.HC_POST), ("Sinkhorn", backends.SINKHORN))]  # fmt: skip
    experts = next((m for m in model.modules() if isinstance(m, GroupedExperts)), None)
    if experts is not None:
        parts.append(f"MoE {experts.impl(config.params_dtype)}")
    return "kernels: " + ", ".join(parts)


def over_steps(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last record with its timing over all of `records`: the mean step time, and each rate at it (a run's
    steps hold the same number of tokens, so each rate scales with 1 / the step time)."""
    last = dict(records[-1])
    mean_time = sum(r["step_time"] for r in records) / len(records)
    scale = last["step_time"] / mean_time
    for key in RATES:
        if last.get(key) is not None:
            last[key] *= scale
    last["step_time"] = mean_time
    return last


@dataclass
class RunReport:
    started: float = field(default_factory=time.perf_counter)
    records: list[dict[str, Any]] = field(default_factory=list)  # this run's steps (not the resumed ones)
    interval_start: int = 0  # the index in `records` where the current log interval began
    best_valid: tuple[float, int] | None = None  # (valid_lm_loss, step)

    def step(self, record: dict[str, Any], log_interval: int) -> str | None:
        """Take one step's record; the periodic line when it is due: timing over the steps since the last one."""
        self.records.append(record)
        if not log_interval or record["step"] % log_interval:
            return None
        interval = self.records[self.interval_start :]
        self.interval_start = len(self.records)
        first = interval[0]["step"]
        span = f" (mean of steps {first}-{record['step']})" if len(interval) > 1 else ""
        return format_record(over_steps(interval)) + span

    def evaluated(self, record: dict[str, Any]) -> None:
        loss = record.get("valid_lm_loss")
        if loss is not None and (self.best_valid is None or loss < self.best_valid[0]):
            self.best_valid = (loss, record["step"])

    def final_line(self) -> str | None:
        """The last step's record with the run's mean timing."""
        return None if not self.records else "final: " + format_record(over_steps(self.records))

    def summary(self, output_dir: str, last_saved: str | None, exports: list[str], plot: bool) -> str:
        wall = time.perf_counter() - self.started
        parts = [f"run: {_duration(wall)} wall"]
        if self.records:
            mean = over_steps(self.records)
            steps = len(self.records)
            tokens = round(sum(r["tokens_per_s"] * r["step_time"] for r in self.records))
            rate = f"{mean['tokens_per_s']:,.0f} tok/s"
            if mean.get("tokens_per_s_per_gpu") is not None:
                rate += f" ({mean['tokens_per_s_per_gpu']:,.0f}/GPU)"
            if mean.get("tflops_per_gpu") is not None:
                rate += f", {mean['tflops_per_gpu']:.3g} TFLOP/s/GPU"
            if mean.get("mfu") is not None:
                rate += f", MFU {mean['mfu']:.1%}"
            parts.append(f"{steps} steps ({self.records[0]['step']}-{self.records[-1]['step']}), {tokens:,} tokens, "
                         f"{rate} over the steps")  # fmt: skip
        if self.best_valid is not None:
            parts.append(f"best valid_lm_loss {self.best_valid[0]:.4f} (step {self.best_valid[1]})")
        if last_saved:
            parts.append(f"last checkpoint {last_saved}")
        parts += [f"exported {path}" for path in exports]
        metrics = os.path.join(output_dir, "metrics.jsonl")
        parts.append(f"metrics {metrics}" + (f", {os.path.join(output_dir, 'loss.png')}" if plot else ""))
        return "; ".join(parts)


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m} min {s} s" if hours else f"{m} min {s} s" if m else f"{seconds:.1f} s"
