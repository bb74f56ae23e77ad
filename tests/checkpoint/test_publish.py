"""Publishing a tag whole or not at all (checkpoint/publish.py): a re-save killed midway keeps the old tag whole, a
tag that is a link is re-saved and what it pointed at kept."""

from __future__ import annotations

import os
import shutil

import pytest

import glm53_ds
from glm53_ds import safe_io
from glm53_ds.config import Glm53Config
from tests.cli import DIE_DURING_SAVE, QUICK, metrics, run
from tests.model_fixtures import CONFIG_A, engine_config, read_manifest_json


@pytest.mark.slow
def test_a_resave_killed_midway_keeps_the_old_tag_whole(tmp_path):
    """Before: a re-save wrote into <tag>/ in place; killed midway it left run 2's replicated tensors beside run 1's
    experts, and --load accepted the mix (rc 0). Now the old tag stays byte for byte, verified, and loads."""
    ck, common = tmp_path / "ck", [*QUICK[2:], "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    assert run("--train-iters", "4", *common, "--output-dir", str(tmp_path / "a")).returncode == 0
    saved = read_manifest_json(ck / "step4")
    # run 2: another learning rate into the same --save, told to replace its tags (a branch from step2 there is
    # refused: tests/training/test_output_dir.py); killed while re-saving step4
    proc = run("--die-during-save", "step4", "--train-iters", "4", *common, "--save-interval", "4",
               "--save-into-existing", "--lr", "1e-2", "--output-dir", str(tmp_path / "b"), script=DIE_DURING_SAVE)  # fmt: skip
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert read_manifest_json(ck / "step4") == saved
    assert safe_io.verify_files(str(ck / "step4"), saved["files"], sorted(saved["files"])) == []
    assert (ck / "latest").read_text() == "step4"  # run 1's, untouched
    assert any(
        n.startswith(".step4.tmp-") for n in os.listdir(ck)
    )  # the killed save's staging, never published
    proc = run("--train-iters", "5", *common, "--load", str(ck), "--output-dir", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "c")] == [5]


def test_a_tag_that_is_a_link_is_resaved_and_its_target_kept(tmp_path):
    """Before: re-saving a tag that was a symlink killed the run (`rmtree` on a link). Now the link is replaced by
    the new tag and what it pointed at stays whole."""
    from glm53_ds.engine import save_checkpoint

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, engine_config(0, False, 1.0))
    ck = tmp_path / "ck"
    save_checkpoint(engine, str(ck), "step1")
    shutil.move(str(ck / "step1"), str(tmp_path / "archived"))
    os.symlink(tmp_path / "archived", ck / "step1")
    save_checkpoint(engine, str(ck), "step1")
    assert (ck / "step1").is_dir() and not (ck / "step1").is_symlink()
    assert (tmp_path / "archived" / "manifest.json").exists()
    assert sorted(os.listdir(ck)) == ["latest", "step1"]


def test_a_save_never_replaces_an_entry_no_save_wrote(tmp_path):
    """A `step1` of the user's in the save directory (not a checkpoint: no manifest) is not replaced by a save of
    that tag: the save stops with a CheckpointError naming it, the user's files and this save's nothing left (its
    staging removed). Control: before, the save removed the user's `step1` whole (`rmtree`) and published its own."""
    from glm53_ds.checkpoint.directory import CheckpointError
    from glm53_ds.engine import save_checkpoint

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, engine_config(0, False, 1.0))
    ck = tmp_path / "ck"
    (ck / "step1").mkdir(parents=True)
    (ck / "step1" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"step1 exists and is not a checkpoint \(no manifest.json\)"):
        save_checkpoint(engine, str(ck), "step1")
    assert (ck / "step1" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(ck)) == ["step1"]  # no staging left, no `latest`
    save_checkpoint(engine, str(ck), "step2")  # another tag: saved beside it
    assert (ck / "step2" / "manifest.json").exists() and (ck / "latest").read_text() == "step2"
