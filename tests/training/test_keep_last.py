"""`--keep-last N`: a long run no longer keeps every checkpoint (each is terabytes at the real size). Once a newer
checkpoint is whole, this run's older tags beyond the newest N are removed; never the one `latest` names, never a
tag another run wrote (each tag records its run's id)."""

from __future__ import annotations

import os

import pytest

from glm53_ds.safe_io import published_tags
from tests.cli import QUICK, run


@pytest.mark.slow
def test_keep_last_removes_only_this_runs_older_tags(tmp_path):
    ck = str(tmp_path / "ck")
    first = run(*QUICK[2:], "--train-iters", "5", "--save", ck, "--save-interval", "5",
                "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert published_tags(ck) == ["step5"]  # another run's tag
    second = run(*QUICK[2:], "--train-iters", "4", "--save", ck, "--save-interval", "1", "--keep-last", "2",
                 "--save-into-existing", "--output-dir", str(tmp_path / "b"))  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    # this run's step1 and step2 went once step3 and step4 were whole; the other run's step5 stays
    assert published_tags(ck) == ["step3", "step4", "step5"], second.stderr[-3000:]
    assert open(os.path.join(ck, "latest")).read().strip() == "step4"
    assert "--keep-last 2: removed step1 (this run's older tags)" in second.stderr
    assert not [n for n in os.listdir(ck) if n.startswith(".")]  # nothing left aside
    # control: without --keep-last every tag stays
    third = run(*QUICK[2:], "--train-iters", "3", "--save", str(tmp_path / "all"), "--save-interval", "1",
                "--output-dir", str(tmp_path / "c"))  # fmt: skip
    assert third.returncode == 0 and published_tags(str(tmp_path / "all")) == ["step1", "step2", "step3"]
