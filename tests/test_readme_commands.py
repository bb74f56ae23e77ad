"""The README's main-job command runs on this machine and lowers the loss (a short version of it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_names_the_commands_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    test_cmd = "python3 -m pytest tests"
    assert test_cmd in readme
    assert re.search(r"^\$PY -m pytest tests$", ci, re.M), "CI must run the README's test command"
    assert "python3 launch/demo_mhc.py" in readme


def test_demo_main_job_lowers_loss():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "demo_mhc.py"), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLM53_HC_POST": "eager"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mean loss first 5 steps" in proc.stdout
