"""The planner's numbers for every recipe and every row of the docs' memory tables are those recorded before the
planner took the run as one typed object (tests/plan/planner_cases.py, planner_numbers.json): exact bytes, the
parameter counts, the trainer's flags and the hints; and every recipe fits."""

from __future__ import annotations

import copy
import glob
import os

import pytest

from tests.cli import ROOT, module_run
from tests.plan.planner_cases import CASES, code_problems, differences, recorded


def test_every_recipe_is_a_recorded_case_and_fits():
    numbers = recorded()
    for path in glob.glob(os.path.join(ROOT, "recipes", "*.toml")):
        name = f"recipe {os.path.basename(path)}"
        assert name in CASES and name in numbers, (
            f"{name}: record it (python -m tests.plan.planner_cases --record)"
        )
        assert numbers[name]["fits"], name
    assert set(numbers) == set(CASES)


def test_the_comparison_sees_a_changed_number_hint_or_exit_code():
    """Control: the check is not blind. A byte of activations more, a hint less, a flag changed, or exit code 0
    for a run that does not fit: each is reported."""
    numbers = recorded()
    case = next(n for n, v in numbers.items() if v["would_fit"])  # a run that does not fit, with its hints
    before = numbers[case]
    assert differences(before, copy.deepcopy(before)) == []
    for change in ("activations", "hint", "flags"):
        after = copy.deepcopy(before)
        if change == "activations":
            after["activations"] += 1
        elif change == "hint":
            after["would_fit"] = after["would_fit"][1:]
        else:
            after["trainer_flags"] += " --sp 2"
        assert len(differences(before, after)) == 1, change
    assert code_problems(dict(before, code=1)) == [] and code_problems(dict(before, code=0)) != []


@pytest.mark.slow
def test_the_planner_gives_the_recorded_numbers():
    """Every case (about 2.5 minutes of one core, in two processes at once: the tests run one at a time, so the
    other core would idle): no number, flag or hint moved; exit code 1 for each run that does not fit, 0 for each
    that does."""
    from concurrent.futures import ThreadPoolExecutor

    halves = [list(CASES)[0::2], list(CASES)[1::2]]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda names: module_run("tests.plan.planner_cases", "--check", *names, timeout=900),
                              halves))  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "differs:" not in proc.stdout
    assert sum(proc.stdout.count("GiB, fits") for proc in procs) == len(CASES)
