"""--output-dir keeps an earlier run's outputs (training/output_dir.py): a fresh run, a weights-only start or a
resume of another run's checkpoint moves them whole into previous-runs/<time>/ and says so; a resume of the run that
wrote them continues its files."""

from __future__ import annotations

import os

import pytest

from glm53_ds.training.output_dir import MARKER, PREVIOUS, RUN_OUTPUTS, claim_output_dir, read_run_id
from glm53_ds.training.state import TrainingState


def _earlier_run(out, run_id: str | None = "0123456789abcdef") -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    files = {name: f"{name} of the earlier run\n" for name in RUN_OUTPUTS}
    for name, text in files.items():
        (out / name).write_text(text)
    if run_id is not None:
        (out / MARKER).write_text(run_id + "\n")
    return files


@pytest.mark.parametrize(
    "start", ["fresh", "weights only", "another run's checkpoint", "a checkpoint before ids"]
)
def test_an_earlier_runs_outputs_are_kept_whole(tmp_path, start):
    """Control: before, a fresh run replaced metrics.jsonl (emptied), run.toml and loss.png in place; the earlier
    run's records and run description were gone."""
    out = tmp_path / "out"
    files = _earlier_run(out)
    resumed_run, resuming = {"fresh": (None, False), "weights only": (None, False),
                             "another run's checkpoint": ("fedcba9876543210", True),
                             "a checkpoint before ids": (None, True)}[start]  # fmt: skip
    run_id, said = claim_output_dir(str(out), resumed_run, resuming)
    (kept,) = os.listdir(out / PREVIOUS)
    assert said == (f"{out} held an earlier run's outputs ({', '.join(RUN_OUTPUTS)}): moved to "
                    f"{out / PREVIOUS / kept}/, this run writes its own")  # fmt: skip
    assert {n: (out / PREVIOUS / kept / n).read_text() for n in RUN_OUTPUTS} == files
    assert read_run_id(str(out / PREVIOUS / kept)) == "0123456789abcdef"
    assert not any((out / n).exists() for n in RUN_OUTPUTS)
    assert read_run_id(str(out)) == run_id != "0123456789abcdef"
    assert run_id == (resumed_run or run_id)  # a resume keeps its checkpoint's id


def test_a_resume_of_the_run_that_wrote_them_continues(tmp_path):
    out = tmp_path / "out"
    files = _earlier_run(out)
    assert claim_output_dir(str(out), "0123456789abcdef", resuming=True) == ("0123456789abcdef", None)
    assert {n: (out / n).read_text() for n in RUN_OUTPUTS} == files and not (out / PREVIOUS).exists()
    # outputs and checkpoint both from before run ids: continued as before (a new id from now on)
    legacy = tmp_path / "legacy"
    _earlier_run(legacy, run_id=None)
    run_id, said = claim_output_dir(str(legacy), None, resuming=True)
    assert said is None and not (legacy / PREVIOUS).exists() and read_run_id(str(legacy)) == run_id


def test_two_runs_in_one_second_keep_both(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(time, "strftime", lambda fmt: "20261204-120000")
    out = tmp_path / "out"
    for _ in range(3):
        _earlier_run(out)
        claim_output_dir(str(out), None, resuming=False)
    assert sorted(os.listdir(out / PREVIOUS)) == ["20261204-120000", "20261204-120000-2", "20261204-120000-3"]


def test_an_empty_or_new_directory_moves_nothing(tmp_path):
    run_id, said = claim_output_dir(str(tmp_path / "new"), None, resuming=False)
    assert (
        said is None
        and os.listdir(tmp_path / "new") == [MARKER]
        and read_run_id(str(tmp_path / "new")) == run_id
    )


def test_checkpoints_record_the_run():
    state = TrainingState(step=3, run="0123456789abcdef")
    assert TrainingState.from_client_state(state.client_state()).run == "0123456789abcdef"
    older = {k: v for k, v in state.client_state().items() if k != "run"}  # a checkpoint from before run ids
    assert TrainingState.from_client_state(older).run is None


def test_a_run_into_an_output_dir_in_use_is_refused(tmp_path, capsys):
    """Before: a second run into the --output-dir of a live one (two jobs, each with its own --save, the default
    --output-dir shared) emptied the live run's metrics.jsonl under it; with this module alone it would move the live
    files aside. Now the directory has a writer's lock like --save's: the second run is refused before it writes
    there, naming the holder. Control: released, the same run trains there."""
    from glm53_ds.engine import close_distributed
    from glm53_ds.safe_io import DirectoryLock
    from glm53_ds.training.errors import SetupError
    from glm53_ds.training.trainer import Trainer
    from tests.cli import QUICK, train_config

    out = tmp_path / "out"
    live = DirectoryLock(str(out), "--output-dir")  # the live run's (this process: a running pid)
    live.acquire()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    second = Trainer(train_config(*QUICK[2:], "--train-iters", "1", "--output-dir", str(out)))
    try:
        with pytest.raises(SetupError, match=rf"--output-dir '{out}'.* being written by another run"):
            second.setup()
        second.close()
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (out / PREVIOUS).exists()
        live.release()
        control = Trainer(train_config(*QUICK[2:], "--train-iters", "1", "--output-dir", str(out)))
        control.run()
        control.close()
        assert (out / PREVIOUS).exists() and not (out / ".glm53-writer.lock").exists()
    finally:
        close_distributed()


@pytest.mark.slow
def test_a_branch_from_an_earlier_checkpoint_destroys_nothing(tmp_path):
    """Before: after a run saved step1..step4, `--load ck --load-tag step2` re-saved ck/step3 and ck/step4 over the
    first run's, moved `latest`, cut metrics.jsonl to steps <= 2 and replaced run.toml and loss.png, without a word.
    Now a branch into the same --save is refused before any work, naming the tags and how to branch; a branch into
    another --save is a new run: the first run's outputs move whole to previous-runs/. Control: resuming from the
    latest tag (not a branch) is accepted and continues the run's files."""
    from glm53_ds.safe_io import published_tags
    from tests.cli import QUICK, one_error, run

    ck, out = str(tmp_path / "ck"), tmp_path / "out"
    common = [*QUICK[2:], "--save-interval", "1", "--output-dir", str(out)]
    first = run(*common, "--train-iters", "4", "--save", ck)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "run.toml")}
    tags = {t: os.path.getmtime(os.path.join(ck, t, "manifest.json")) for t in published_tags(ck)}
    error = one_error(run(*common, "--train-iters", "4", "--save", ck, "--load", ck, "--load-tag", "step2",
                          "--lr", "1e-3"))  # fmt: skip
    assert f"--load-tag step2 with --save {ck}: it holds later checkpoints (step3, step4)" in error, error
    assert f"--save {ck}-from-step2" in error
    assert {t: os.path.getmtime(os.path.join(ck, t, "manifest.json")) for t in published_tags(ck)} == tags
    assert {n: (out / n).read_bytes() for n in before} == before
    branch = run(*common, "--train-iters", "3", "--save", str(tmp_path / "branch"), "--load", ck, "--load-tag",
                 "step2", "--lr", "1e-3")  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-3000:]
    assert "held an earlier run's outputs" in branch.stderr
    (moved,) = os.listdir(out / PREVIOUS)
    assert {n: (out / PREVIOUS / moved / n).read_bytes() for n in before} == before
    assert published_tags(ck) == ["step1", "step2", "step3", "step4"] and published_tags(
        str(tmp_path / "branch")
    ) == ["step3"]
    resumed = run(
        *common, "--train-iters", "5", "--save", str(tmp_path / "branch"), "--load", str(tmp_path / "branch")
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "held an earlier run's outputs" not in resumed.stderr  # the control: a resume continues its files
