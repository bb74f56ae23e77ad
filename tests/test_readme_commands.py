"""README.md's first two fenced bash blocks are the two commands (one line each: install + main job, install +
tests); CI extracts and runs the second as written (the main job itself runs in tests/training/test_trainer.py)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)[:2]]


def test_readme_opens_with_the_two_commands():
    main_job, tests = readme_commands()
    assert "\n" not in main_job and "\n" not in tests
    assert main_job == "pip install -e . && deepspeed launch/train.py"
    assert tests == 'pip install -e ".[test]" && python3 -m pytest tests -n 2 --dist loadfile'


def test_the_longest_files_collected_first_exist():
    """tests/conftest.py's LONGEST_FIRST orders the two workers' files: a renamed file would drop out of it."""
    from tests.conftest import LONGEST_FIRST

    missing = [path for path in LONGEST_FIRST if not os.path.isfile(os.path.join(ROOT, path))]
    assert missing == [], missing


def test_ci_runs_the_second_block_without_a_copy():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert "blocks[1]" in ci and 'bash -euo pipefail -c "$block"' in ci
    assert "pytest tests" not in ci  # the command comes from README.md only
