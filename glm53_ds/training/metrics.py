"""Training metrics: JSONL file, optional TensorBoard, and a PNG loss curve at the end (rank 0 only).

metrics.jsonl holds one record per optimizer step (`StepMetrics`) and one per evaluation (`step` and `valid_*`
keys: `Trainer.evaluate`); TensorBoard and Weights & Biases (optional, `WandbRun`) get them as `train/<key>` and
`valid/<key>`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..safe_io import atomic_write_text

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step's metrics, from the step's one reduction (`Trainer.train_step`). Optional values are None
    when the run has no such part (no MTP, no indexer loss, unpacked data, no MoE)."""

    step: int  # 1-based
    consumed_samples: int
    loss: float  # the total the optimizer saw (global token mean of each part, weighted)
    lm_loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    step_time: float
    moe_imbalance: float | None
    target_tokens: int
    packing_efficiency: float | None = None  # real tokens / row tokens (packed rows)
    mtp_loss: float | None = None
    indexer_loss: float | None = None
    update_skipped: bool | None = None  # True: a global batch without target tokens, nothing applied
    tokens_per_s_per_gpu: float | None = None  # tokens_per_s / ranks
    tflops_per_gpu: float | None = None  # the FLOP model's (glm53_ds/flops.py) model FLOP/s per rank
    mfu: float | None = None  # tflops_per_gpu / the GPU's bf16 peak (known GPUs, or --peak-tflops)

    OPTIONAL = (
        "packing_efficiency",
        "mtp_loss",
        "indexer_loss",
        "update_skipped",
        "tokens_per_s_per_gpu",
        "tflops_per_gpu",
        "mfu",
    )
    TIMING = ("tokens_per_s", "step_time", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")  # vary run to run

    def as_record(self) -> dict[str, Any]:
        """The metrics.jsonl record: every field, the optional ones only when the run has them."""
        return {k: v for k, v in vars(self).items() if v is not None or k not in self.OPTIONAL}


@dataclass(frozen=True)
class WandbRun:
    """Where a run logs to Weights & Biases (`--wandb-project`): its project, run name, mode ("online", or
    "offline": written under the output directory, no network; `wandb sync` uploads it later) and the run's
    configuration."""

    project: str
    mode: str = "online"
    name: str | None = None
    config: dict[str, Any] | None = None


def scalar_tag(key: str) -> str:
    """The TensorBoard / W&B name of a metrics.jsonl key: `valid/<key>` for an evaluation's, else `train/<key>`."""
    return f"valid/{key.removeprefix('valid_')}" if key.startswith("valid_") else f"train/{key}"


class MetricsWriter:
    def __init__(self, output_dir: str, tensorboard_dir: str | None, resume_step: int | None = None,
                 wandb_run: WandbRun | None = None) -> None:  # fmt: skip
        """`resume_step`: a resumed run keeps the records up to that step (an interrupted run's later steps are
        dropped, so no step appears twice); None starts a new file. `wandb_run`: also log to W&B (the package is
        checked for when the options are read: `TrainConfig`)."""
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        kept = []
        if resume_step is not None and os.path.isfile(self.path):
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._tb = None
        if tensorboard_dir:
            try:  # optional: the run goes on without it
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("notice: --tensorboard-dir ignored: the tensorboard package is not installed "
                      "(pip install tensorboard)", file=sys.stderr)  # fmt: skip
            else:
                self._tb = SummaryWriter(tensorboard_dir)
        self._wandb: Any = None
        if wandb_run is not None:
            import wandb  # an optional extra: pip install "glm53_ds[wandb]"

            self._wandb = wandb.init(project=wandb_run.project, name=wandb_run.name, mode=wandb_run.mode,
                                     dir=output_dir, config=wandb_run.config)  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {scalar_tag(k): v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def write_samples(self, step: int, samples: list[dict[str, str]]) -> None:
        """Generated samples: a line each in samples.jsonl beside metrics.jsonl, and as text in TensorBoard /
        W&B."""
        path = os.path.join(os.path.dirname(self.path), "samples.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n")
        text = "\n\n".join(f"**{s['prompt']}**\n\n{s['completion']}" for s in samples)
        if self._tb is not None:
            self._tb.add_text("samples", text, step)
        if self._wandb is not None:
            self._wandb.log({"samples": text}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def is_validation(record: dict[str, Any]) -> bool:
    return "valid_lm_loss" in record


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a last line cut off by a killed run is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def plot_loss(metrics_path: str, png_path: str) -> None:
    """The loss curve as a PNG; skipped with a one-line notice when matplotlib is missing (optional)."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"notice: {png_path} not written: matplotlib is not installed (pip install matplotlib)",
            file=sys.stderr,
        )
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(metrics_path)
    records = [r for r in everything if not is_validation(r)]
    valid = [r for r in everything if is_validation(r)]
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, [r["lm_loss"] for r in records], label="LM loss")
    if any("mtp_loss" in r for r in records):
        ax.plot(steps, [r.get("mtp_loss", float("nan")) for r in records], label="MTP loss")
    if valid:
        ax.plot(
            [r["step"] for r in valid], [r["valid_lm_loss"] for r in valid], "o-", label="validation LM loss"
        )
        if any("valid_mtp_loss" in r for r in valid):
            ax.plot([r["step"] for r in valid], [r.get("valid_mtp_loss", float("nan")) for r in valid], "s--",
                    label="validation MTP loss")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)


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


def loggable(config: TrainConfig) -> dict[str, Any]:
    """The run's options as a W&B run configuration (plain values)."""
    return {
        k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, str | int | float | bool | None)
    }
