"""Whose outputs `--output-dir` holds, and an earlier run's kept whole, never replaced.

A run writes `run.toml`, `metrics.jsonl`, `samples.jsonl` and `loss.png` there (rank 0). Before any of them, set-up
claims the directory: `.glm53-run` names the run whose outputs these are. A run id is made at a fresh start and
carried on by every checkpoint (`TrainingState.run`), so a resume of that run continues its files (metrics.jsonl
keeps the records up to the resumed step: metrics.py). Anything else, a fresh run, a `--load-model-only`, a resume of
another run's checkpoint, finds an earlier run's outputs and moves them whole into
`previous-runs/<time>/` beside them, said in one line: the same command run twice keeps both runs' metrics and run
descriptions. Outputs and a checkpoint from before run ids (neither records one) continue as before.
"""

from __future__ import annotations

import os
import time
import uuid

from ..safe_io import DirectoryLock, atomic_write_text

RUN_OUTPUTS = ("run.toml", "metrics.jsonl", "samples.jsonl", "loss.png")  # what a run writes there
MARKER = ".glm53-run"  # the id of the run whose outputs the directory holds
PREVIOUS = "previous-runs"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def read_run_id(output_dir: str) -> str | None:
    """The run the directory's outputs belong to (None: no marker, or not one the trainer wrote)."""
    path = os.path.join(output_dir, MARKER)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.isalnum() else None


def claim_output_dir(output_dir: str, resumed_run: str | None, resuming: bool) -> tuple[str, str | None]:
    """(this run's id, the line saying where an earlier run's outputs went, or None). `resuming`: a training
    checkpoint's state was loaded (step > 0); `resumed_run`: the run id it records (None before run ids)."""
    os.makedirs(output_dir, exist_ok=True)
    present = [n for n in RUN_OUTPUTS if os.path.lexists(os.path.join(output_dir, n))]
    owner = read_run_id(output_dir)
    continues = resuming and owner == resumed_run  # both None: outputs and checkpoint from before run ids
    run_id = resumed_run if resuming and resumed_run else new_run_id()
    said = None
    if present and not continues:
        moved = present + ([MARKER] if os.path.lexists(os.path.join(output_dir, MARKER)) else [])
        destination = _new_dir(os.path.join(output_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S")))
        for name in moved:
            os.replace(os.path.join(output_dir, name), os.path.join(destination, name))
        said = (f"{output_dir} held an earlier run's outputs ({', '.join(present)}): moved to {destination}/, this "
                "run writes its own")  # fmt: skip
    atomic_write_text(os.path.join(output_dir, MARKER), run_id + "\n")
    return run_id, said


def _new_dir(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... : a directory this run creates (never one that exists)."""
    candidate, n = path, 1
    while True:
        try:
            os.makedirs(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}-{n}"


def writer_locks(save: str | None, output_dir: str) -> list[DirectoryLock]:
    """The writer's locks a run takes (rank 0, for the run): --save's and --output-dir's, one where the two are one
    directory, so that a second run into either is refused before it writes there."""
    locks: list[DirectoryLock] = []
    for option, directory in (("--save", save), ("--output-dir", output_dir)):
        if directory and all(os.path.realpath(directory) != os.path.realpath(h.directory) for h in locks):
            locks.append(DirectoryLock(directory, option))
    return locks
