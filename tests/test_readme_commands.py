"""README.md keeps the two commands, and CI runs the test one exactly (the main job runs in test_train.py)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_names_the_commands_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert "\npython3 -m pytest tests\n" in readme
    assert re.search(r"^\$PY -m pytest tests$", ci, re.M), "CI must run the README's test command"
    assert "\ndeepspeed launch/train.py\n" in readme
