"""`CheckpointDir` (checkpoint/directory.py), the one reader: every reader checks the manifest, index entries stay
inside the checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from glm53_ds import safe_io
from tests.cli import ROOT


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from glm53_ds.convert import hf_to_native
    from tests.cli import tiny_hf_checkpoint

    base = tmp_path_factory.mktemp("converted")
    tiny_hf_checkpoint(base / "hf")
    return base, hf_to_native(str(base / "hf"), str(base / "native"), ep=2)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def test_every_reader_checks_the_manifest(converted, tmp_path):
    """Before: one flipped byte made --load refuse, but native-to-hf wrote `lm_head.weight[100] = -1.1e37` (and
    verify / load_native read it). Now each refuses, naming the file, and the export writes nothing."""
    from glm53_ds.convert import native_to_hf, verify
    from glm53_ds.convert.export_hf import load_native

    base, native = converted
    damaged = tmp_path / "damaged"
    shutil.copytree(native, damaged)
    shard = sorted((damaged / "hf" / "glm53").glob("replicated-*.safetensors"))[0]
    _flip_a_byte(shard)
    message = rf"damaged or incomplete: glm53/{shard.name} does not match its checksum"
    with pytest.raises(ValueError, match=message):
        native_to_hf(str(damaged), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=message):
        verify(str(base / "hf"), str(damaged), out=lambda *a: None)
    with pytest.raises(ValueError, match=message):
        load_native(str(damaged))
    # control: the undamaged checkpoint exports
    native_to_hf(native, str(tmp_path / "good"))
    assert (tmp_path / "good" / "model.safetensors.index.json").exists()


def test_index_entries_stay_inside_the_checkpoint(converted, tmp_path):
    """Before: an index entry `../x.safetensors` read a file outside the checkpoint that the manifest never checked;
    describe said complete and the resume ran. Now the readers and describe refuse it (the manifest rewritten to
    match, as an attacker who knows the format would)."""
    from glm53_ds.convert.describe import describe_checkpoint
    from glm53_ds.convert.export_hf import load_native

    _, native = converted
    copy = tmp_path / "copy"
    shutil.copytree(native, copy)
    model_dir = copy / "hf" / "glm53"
    shard = sorted(model_dir.glob("replicated-*.safetensors"))[0]
    shutil.move(str(shard), str(tmp_path / shard.name))  # outside the checkpoint
    index = json.loads((model_dir / "replicated.index.json").read_text())
    index["weight_map"] = {
        k: ("../../../" + v if v == shard.name else v) for k, v in index["weight_map"].items()
    }
    (model_dir / "replicated.index.json").write_text(json.dumps(index))
    tag = copy / "hf"
    entries = json.loads((tag / "manifest.json").read_text())["files"]
    del entries[f"glm53/{shard.name}"]
    safe_io.write_manifest(
        str(tag), entries | safe_io.describe_files(str(tag), ["glm53/replicated.index.json"])
    )
    rows: list[str] = []
    assert describe_checkpoint(str(copy), out=rows.append) == 1
    assert any("not a plain file name" in r for r in rows), rows
    with pytest.raises(ValueError, match=r"names the file '\.\./\.\./\.\./replicated-"):
        load_native(str(copy))
    # the manifest itself may not point outside either
    with pytest.raises(ValueError, match="a path outside the checkpoint directory"):
        safe_io.write_manifest(str(tag), entries | {"../elsewhere.bin": {"size": 1, "crc32": "0"}})
        safe_io.read_manifest(str(tag))


def _latest_literals(source: str) -> int:
    import ast

    return sum(isinstance(n, ast.Constant) and n.value == "latest" for n in ast.walk(ast.parse(source)))


def test_the_latest_file_is_read_and_written_only_in_checkpoint():
    """`<dir>/latest` has one reader and one writer (checkpoint/directory.py); before, training/config.py and
    convert/import_hf.py opened it themselves. Control: a module joining "latest" itself is found."""
    root = os.path.join(ROOT, "glm53_ds")
    offenders = []
    for directory, _, files in os.walk(root):
        if os.path.relpath(directory, root).split(os.sep)[0] == "checkpoint":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                if _latest_literals(open(path, encoding="utf-8").read()):
                    offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []
    assert _latest_literals('open(os.path.join(load, "latest")).read()') == 1
    assert (
        _latest_literals("help=\"resume from its 'latest' tag\"") == 0
    )  # words in a help text are not a path
