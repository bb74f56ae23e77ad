"""The command lines' --help is not preceded by warnings: the trainer's (training/args.py), the planner's and the
dry run's (glm53_ds/__init__.py leaves megatron's notices about optional packages out while it imports megatron)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli import ROOT, TRAIN


@pytest.mark.slow
def test_help_is_not_preceded_by_warnings():
    """Before: five Apex / Transformer-Engine warnings and DeepSpeed's accelerator guess came before the usage."""
    proc = subprocess.run(
        [sys.executable, TRAIN, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: deepspeed launch/train.py")
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["glm53_ds.plan", "glm53_ds.plan.dry_run"])
def test_the_planners_help_is_not_preceded_by_warnings(module):
    """Before: ten lines of Transformer Engine / Apex notices came before `python -m glm53_ds.plan --help`."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-2000:]
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr[-2000:]
