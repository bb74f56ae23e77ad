"""The trainer's command line (training/args.py): --help is not preceded by warnings."""

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
