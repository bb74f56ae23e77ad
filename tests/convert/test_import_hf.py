"""The HF import (convert/import_hf.py): a failed conversion leaves nothing behind."""

from __future__ import annotations

import os

import pytest


def test_a_failed_conversion_leaves_no_temporary_directory(hf_dir, tmp_path, monkeypatch):
    """Before: each failure left `<out>.tmp<pid>/` with the shards written so far."""
    from glm53_ds.checkpoint import ShardWriter
    from glm53_ds.convert import hf_to_native

    calls = {"n": 0}
    real_add = ShardWriter.add

    def failing_add(self, key, tensor):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real_add(self, key, tensor)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    (tmp_path / "unrelated").mkdir()
    with pytest.raises(OSError, match="disk full"):
        hf_to_native(str(hf_dir), str(tmp_path / "native"))
    assert sorted(os.listdir(tmp_path)) == ["unrelated"]
