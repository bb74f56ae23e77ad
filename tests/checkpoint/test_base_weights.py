"""`checkpoint/base_weights.py`: the fingerprint knows a base again (a copy elsewhere keeps it) and tells another
one of the same shapes (one changed value anywhere in a sampled region: start, middle or end of a file's data)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from glm53_ds.checkpoint.base_weights import SAMPLE, BaseMismatch, base_record, check_base, fingerprint


def _base(path, value: float = 1.0) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    big = torch.full((3 * SAMPLE // 4,), value)  # 3 MiB of data: the three samples do not overlap
    save_file({"w": big, "b": torch.zeros(4)}, str(path / "model-00001.safetensors"))


def test_a_copy_keeps_the_fingerprint_and_any_sampled_change_breaks_it(tmp_path):
    _base(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    want = fingerprint(str(tmp_path / "a"), "config.json")
    assert fingerprint(str(tmp_path / "copy"), "config.json") == want
    n = 3 * SAMPLE // 4
    for where in (0, n // 2, n - 1):  # start, middle, end of the data
        other = tmp_path / f"other{where}"
        _base(other)
        big = torch.ones(n)
        big[where] = 2.0
        save_file({"w": big, "b": torch.zeros(4)}, str(other / "model-00001.safetensors"))
        assert fingerprint(str(other), "config.json") != want, where
    (tmp_path / "copy" / "config.json").write_text(json.dumps({"hidden_size": 9}))
    assert fingerprint(str(tmp_path / "copy"), "config.json") != want


def test_check_base_names_both(tmp_path):
    _base(tmp_path / "a")
    _base(tmp_path / "b", value=3.0)
    a, b = base_record("hf", str(tmp_path / "a")), base_record("hf", str(tmp_path / "b"))
    check_base(a, base_record("hf", str(tmp_path / "a")), "--hf-dir a")
    with pytest.raises(
        BaseMismatch, match=r"--hf-dir b: the released-layout weights .*/b, .* is not the base .*/a"
    ):
        check_base(a, b, "--hf-dir b")
