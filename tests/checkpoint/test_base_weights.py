"""`checkpoint/base_weights.py`: a base's record knows it again (a copy elsewhere keeps it) and tells any other one
of the same shapes, one changed byte anywhere in any file, naming the file. Before: a fingerprint over three 1 MiB
samples per file, blind to an edit between them (the control below); such older records still check as made."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from glm53_ds.checkpoint.base_weights import (
    SAMPLE,
    BaseMismatch,
    base_record,
    check_base,
    describe_base,
    sampled_fingerprint,
)

N = 3 * SAMPLE  # 12 MiB of fp32 data: the three samples cover a quarter of it


def _base(path, value: float = 1.0, changed_at: int | None = None) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    big = torch.full((N,), value)
    if changed_at is not None:
        big[changed_at] = 2.0
    save_file({"w": big, "b": torch.zeros(4)}, str(path / "model-00001.safetensors"))


def test_a_copy_keeps_the_record_and_any_change_breaks_it_naming_the_file(tmp_path):
    _base(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    want = base_record("hf", str(tmp_path / "a"))
    check_base(want, base_record("hf", str(tmp_path / "copy")), "--hf-dir copy")
    between = N // 4  # between the start and middle samples
    for where in (0, between, N // 2, N - 1):
        _base(tmp_path / f"other{where}", changed_at=where)
        with pytest.raises(BaseMismatch, match=r"model-00001\.safetensors differs"):
            check_base(want, base_record("hf", str(tmp_path / f"other{where}")), f"--hf-dir other{where}")
    (tmp_path / "copy" / "config.json").write_text(json.dumps({"hidden_size": 9}))
    with pytest.raises(BaseMismatch, match=r"config\.json differs"):
        check_base(want, base_record("hf", str(tmp_path / "copy")), "--hf-dir copy")


def test_the_sampled_fingerprint_missed_an_edit_between_samples_control(tmp_path):
    """The old record: the same edit between the samples (same size, header) passes it."""
    _base(tmp_path / "a")
    _base(tmp_path / "edited", changed_at=N // 4)
    assert sampled_fingerprint(str(tmp_path / "a"), "config.json") == sampled_fingerprint(
        str(tmp_path / "edited"), "config.json"
    )


def test_an_older_sampled_record_is_checked_as_made_and_said(tmp_path):
    _base(tmp_path / "a")
    _base(tmp_path / "b", value=3.0)
    old = dict(
        kind="hf",
        path=str(tmp_path / "a"),
        fingerprint=sampled_fingerprint(str(tmp_path / "a"), "config.json"),
    )
    notice = check_base(old, base_record("hf", str(tmp_path / "a")), "--hf-dir a")
    assert notice is not None and "samples of each file only" in notice
    with pytest.raises(
        BaseMismatch, match=r"--hf-dir b: the released-layout weights .*/b, .* is not the base .*/a"
    ):
        check_base(old, base_record("hf", str(tmp_path / "b")), "--hf-dir b")


def test_check_base_names_both(tmp_path):
    _base(tmp_path / "a")
    _base(tmp_path / "b", value=3.0)
    a, b = base_record("hf", str(tmp_path / "a")), base_record("hf", str(tmp_path / "b"))
    assert check_base(a, base_record("hf", str(tmp_path / "a")), "--hf-dir a") is None
    assert "2 files checksummed" in describe_base(a)  # config.json and the weights
    with pytest.raises(
        BaseMismatch, match=r"--hf-dir b: the released-layout weights .*/b, .* is not the base .*/a"
    ):
        check_base(a, b, "--hf-dir b")
