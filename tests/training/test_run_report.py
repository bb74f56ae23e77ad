"""What a run says about itself (training/run_report.py): the kernels it resolved, the periodic lines' throughput
over their interval, the end-of-run summary."""

from __future__ import annotations

import pytest

from glm53_ds.training.run_report import RunReport, over_steps
from tests.cli import QUICK, metrics, run


def _record(step: int, step_time: float, tokens: int = 100) -> dict:
    return dict(step=step, lm_loss=1.0, loss=1.0, lr=1e-3, grad_norm=1.0, step_time=step_time,
                tokens_per_s=tokens / step_time, tokens_per_s_per_gpu=tokens / step_time / 2,
                tflops_per_gpu=tokens / step_time * 1e-3, mfu=tokens / step_time * 1e-4)  # fmt: skip


def test_the_periodic_line_gives_its_intervals_throughput():
    """Before: the periodic and `final:` lines showed one step's tokens/s (a slow step 60 said 94 tok/s of a run
    that averaged 199). Now the steps since the last line: their tokens over their time."""
    report = RunReport()
    times = [1.0, 1.0, 4.0]  # the interval's last step is slow
    lines = [report.step(_record(i + 1, t), log_interval=3) for i, t in enumerate(times)]
    assert lines[:2] == [None, None]
    mean = 300 / sum(times)  # 50 tok/s; the last step alone: 25
    assert f"{mean:.0f} tok/s ({mean / 2:.0f}/GPU)" in lines[2] and "(mean of steps 1-3)" in lines[2]
    assert over_steps([_record(3, 4.0)])["tokens_per_s"] == 25  # the control: one step's own rate
    assert over_steps([_record(1, 1.0), _record(2, 3.0)])["mfu"] == pytest.approx(200 / 4 * 1e-4)
    # the next interval starts after this line
    assert "(mean of steps 4-6)" in [report.step(_record(i, 1.0), 3) for i in (4, 5, 6)][-1]


@pytest.mark.slow
def test_a_run_says_its_kernels_and_ends_with_a_summary(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ck"
    proc = run(*QUICK, "--train-iters", "4", "--save", str(ck), "--log-interval", "2", "--valid-split", "0.2",
               "--eval-interval", "2", "--output-dir", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # CPU: the torch reference of each kernel, `auto` said as what it resolved to
    assert "kernels: attention sparse, KDA torch, mHC post eager, Sinkhorn torch, MoE " in proc.stderr, (
        proc.stderr[-3000:]
    )
    summary = next(line for line in proc.stderr.splitlines() if line.startswith("run: "))
    records = [r for r in metrics(out) if "lm_loss" in r]
    valid = min((r["valid_lm_loss"], r["step"]) for r in metrics(out) if "valid_lm_loss" in r)
    tokens = round(sum(r["tokens_per_s"] * r["step_time"] for r in records))
    assert f"4 steps (1-4), {tokens:,} tokens" in summary, summary
    assert f"best valid_lm_loss {valid[0]:.4f} (step {valid[1]})" in summary, summary
    assert f"last checkpoint {ck / 'step4'}" in summary and f"metrics {out / 'metrics.jsonl'}" in summary
    mean = sum(r["tokens_per_s"] * r["step_time"] for r in records) / sum(r["step_time"] for r in records)
    final = next(line for line in proc.stdout.splitlines() if line.startswith("final: "))
    assert f"{mean:.0f} tok/s" in final, (final, mean)
