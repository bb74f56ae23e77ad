"""Every reader of a checkpoint checks what it reads against the tag's manifest (`CheckpointDir`, `check_files` on
by default): a flipped byte, a file the manifest does not list, and a killed save's staging directory (no
manifest) are refused by each reader, one test per reader, so that a new reader cannot skip the check.

Before: `native-to-peft` exported a flipped byte as 3.3e37, an unlisted file and a manifest-less staging directory
with rc 0 (it opened the tag without `check_files`); so did `read_client_state`, `check_checkpoint_fits` and the
trainer's reading of --load's model config. The control below opens the tag as they did (`check_files=False`)
and reads the damage without a word."""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import pytest
import torch

from glm53_ds.checkpoint import CLIENT_STATE, CheckpointDir
from glm53_ds.checkpoint.directory import LAYOUT
from glm53_ds.convert import load_native, native_to_hf
from glm53_ds.convert.export_adapter import native_to_peft
from glm53_ds.engine.checkpoint import check_checkpoint_fits, read_client_state
from glm53_ds.layers.lora import LoraSpec
from glm53_ds.training.config import SetupError
from glm53_ds.training.model_source import resolve_model
from tests.model_fixtures import save_lora_native

REPO = pathlib.Path(__file__).resolve().parents[2]
EMBEDDING = "embedding.weight"
SPEC = LoraSpec(rank=2, alpha=4.0, targets=("mla",))


@pytest.fixture(scope="module")
def lora_tag(tmp_path_factory):
    return save_lora_native(tmp_path_factory.mktemp("readers"), SPEC)


def _flip(path: pathlib.Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) - 3 if at is None else at
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_layout(path: pathlib.Path) -> None:
    """The same size, another value: what a flipped byte in layout.json reads as."""
    text = path.read_text()
    path.write_text(text.replace('"etp": 1', '"etp": 7', 1))


DAMAGES = {
    "flipped byte": lambda tag: (
        _flip(tag / "glm53" / "replicated-00001.safetensors"),
        _edit_layout(tag / "glm53" / LAYOUT),
        _flip(tag / "glm53" / CLIENT_STATE, 40),
    ),  # fmt: skip
    "unlisted file": lambda tag: (tag / "glm53" / "extra-00001.safetensors").write_bytes(b"x"),
    "no manifest (a killed save's staging directory)": lambda tag: (tag / "manifest.json").unlink(),
}
REFUSED = r"damaged or incomplete|not in the manifest|no manifest\.json|does not match its checksum"


def _copy(lora_tag, tmp_path):
    tag = tmp_path / "ck" / "step3"
    shutil.copytree(lora_tag, tag)
    return tag


READERS = {
    "CheckpointDir.full_tensor": lambda tag, out: CheckpointDir(str(tag)).full_tensor(EMBEDDING),
    "load_native": lambda tag, out: load_native(str(tag)),
    "native_to_hf": lambda tag, out: native_to_hf(str(tag), str(out)),
    "native_to_peft": lambda tag, out: native_to_peft(str(tag), str(out)),
    "read_client_state": lambda tag, out: read_client_state(str(tag.parent), tag.name),
    "check_checkpoint_fits": lambda tag, out: check_checkpoint_fits(
        str(tag.parent), tag.name, CheckpointDir(str(tag), check_files=False).model_config, {}
    ),
    "resolve_model (--load's config)": lambda tag, out: resolve_model(None, None, str(tag.parent), tag.name),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_a_damaged_tag(lora_tag, tmp_path, reader, damage):
    tag = _copy(lora_tag, tmp_path)
    READERS[reader](tag, tmp_path / "out_ok")  # the undamaged tag reads
    DAMAGES[damage](tag)
    with pytest.raises((ValueError, SetupError), match=REFUSED):
        READERS[reader](tag, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written from a damaged tag


def test_without_the_check_the_damage_reads_silently_control(lora_tag, tmp_path):
    tag = _copy(lora_tag, tmp_path)
    _flip(tag / "glm53" / "replicated-00001.safetensors")
    (tag / "manifest.json").unlink()
    (tag / "glm53" / "extra-00001.safetensors").write_bytes(b"x")
    damaged, whole = CheckpointDir(str(tag), check_files=False), CheckpointDir(str(lora_tag))
    changed = [
        n for n in sorted(damaged.keys()) if not torch.equal(damaged.full_tensor(n), whole.full_tensor(n))
    ]
    assert len(changed) == 1  # opened and read without a word: no manifest, an unlisted file, a flipped byte


def test_only_describe_opens_a_tag_unchecked():
    """The structural guard: `check_files=False` appears in the package only where `describe` reports problems."""
    found = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "glm53_ds").rglob("*.py")
        if re.search(r"check_files\s*=\s*False\s*[,)]", path.read_text())
    )
    assert found == ["glm53_ds/convert/describe.py"], found


def test_the_trainers_readers_skip_the_file_check_only_after_the_whole_tag_is_verified(lora_tag, tmp_path):
    """`verify_checkpoint` (collective) marks the tag; a later reader in the process does not re-read every file;
    a re-saved tag (another manifest) is checked again."""
    from glm53_ds.checkpoint.directory import _is_verified, mark_verified

    tag = _copy(lora_tag, tmp_path)
    assert not _is_verified(str(tag))
    mark_verified(str(tag))
    assert _is_verified(str(tag)) and CheckpointDir(str(tag))._manifest is None
    os.utime(tag / "manifest.json", ns=(1, 1))
    assert not _is_verified(str(tag)) and CheckpointDir(str(tag))._manifest is not None
