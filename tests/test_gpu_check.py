"""The GPU check (`benchmarks/gpu_check.sh`) cannot lose what it measures: its steps fit 540 s of a 600 s call (the install
of the carried wheels takes about 10 s), in
the order of their worth, and a run (the CPU dry run: the same code path) leaves in $OUT the log from its first
line, a summary of every step and at most 8 files. Before: the limits added up to 600 s before the install, the
log lived outside $OUT, 20+ files were copied (8 come back), and a step printed its rows only when it ended."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.cli import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def test_the_plan_fits_the_window_in_the_order_of_worth():
    out = subprocess.run(
        ["bash", SCRIPT, "--plan"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    lines = out.strip().splitlines()
    total = int(re.fullmatch(r"total (\d+) s", lines[-1]).group(1))
    limits = [int(re.search(r"\s(\d+) s\s", line).group(1)) for line in lines[:-1]]
    assert total == sum(limits) <= 540
    names = [line.split()[1] for line in lines[:-1]]
    assert names[:7] == ["imports", "smoke", "dsa_kernel", "moe_experts", "kda", "model_step", "train"]
    assert limits[1] <= 30  # the smoke step


@pytest.mark.slow
def test_a_dry_run_leaves_its_log_and_summary_in_out(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", SCRIPT, "--dry-run", "--steps", "imports", "smoke", "train"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert files == ["gpu_check.log", "summary.json", "train_metrics.jsonl"] and len(files) <= 8
    log = (out / "gpu_check.log").read_text()
    assert log.startswith("gpu_check ") and "=== smoke: ok after" in log and "import megatron.core:" in log
    summary = json.loads((out / "summary.json").read_text())
    assert [s["rc"] for s in summary["steps"].values()] == [0, 0, 0]
    train = summary["steps"]["train"]["results"]["train/metrics.jsonl"]
    assert train["records"] == 3 and train["mean_tflops_per_gpu"] > 0
