"""The HF export (convert/export_hf.py): a template of another model refused, the tokenizer carried, an export that
transformers loads and the trainer starts from again."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli import QUICK, run


def test_a_template_of_another_model_is_refused(hf_dir, tmp_path):
    """Before: any --hf-template was taken (rc 0, an export transformers could not load)."""
    from glm53_ds.convert import hf_to_native, native_to_hf
    from glm53_ds.convert.import_hf import ConversionError

    native = hf_to_native(str(hf_dir), str(tmp_path / "native"))
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 256
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConversionError, match=r"another model .* intermediate_size: checkpoint 128, template 256"
    ):
        native_to_hf(native, str(tmp_path / "out"), hf_template=str(other))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_carries_the_tokenizer_files(hf_dir, tmp_path):
    source = tmp_path / "hf"
    import shutil

    shutil.copytree(hf_dir, source)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (source / "generation_config.json").write_text('{"do_sample": false}')
    proc = run(*QUICK[:2], "--hf-dir", str(source), "--tokenizer", "bytes", "--output-dir", str(tmp_path / "out"),
               "--export-hf", str(tmp_path / "export"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --hf-dir's generation settings travel; the tokenizer is the one the run trained with (here the byte tokenizer,
    # written as a real one: tests/training/test_config.py), not --hf-dir's placeholder
    gen = "generation_config.json"
    assert (tmp_path / "export" / gen).read_text() == (source / gen).read_text()
    assert (
        json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["eos_token"]
        == "<|endoftext|>"
    )
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # the export's work directory is gone


@pytest.mark.slow
def test_an_export_is_loadable_and_trains_again_as_hf_dir(tmp_path):
    """Before: with the byte tokenizer (or --tokenizer DIR) --export-hf wrote no tokenizer and no
    generation_config.json, and the export fed back as --hf-dir failed inside transformers, once per rank."""
    from transformers import AutoTokenizer

    export = tmp_path / "export"
    proc = run(*QUICK, "--output-dir", str(tmp_path / "a"), "--export-hf", str(export))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {export}" in proc.stderr
    assert AutoTokenizer.from_pretrained(export).encode("ab", add_special_tokens=False) == [97, 98]
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 256
    again = run(*QUICK, "--hf-dir", str(export), "--output-dir", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]


def test_the_exports_config_says_the_dtype_of_its_weights(hf_dir, tmp_path):
    """Before: config.json was carried verbatim from the base, so a bf16 export of a float32 base said "dtype":
    "float32" (and the reverse). Now the export's config names the dtype most of its weights are in: here float32
    weights under a base config that says bfloat16 (both keys, top level and text config); a config that already
    says it is left byte for byte."""
    import torch

    from glm53_ds.convert import hf_to_native, native_to_hf
    from glm53_ds.convert.export_hf import say_weights_dtype

    native = hf_to_native(str(hf_dir), str(tmp_path / "native"))
    base = json.loads((hf_dir / "config.json").read_text())
    base["dtype"] = "bfloat16"
    base["text_config"]["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(base))
    native_to_hf(native, str(tmp_path / "out"), config_json=str(tmp_path / "config.json"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["dtype"], written["text_config"]["torch_dtype"]) == ("float32", "float32")
    assert {k: v for k, v in written.items() if k != "dtype"}["model_type"] == base["model_type"]
    before = (tmp_path / "out" / "config.json").read_bytes()
    say_weights_dtype(str(tmp_path / "out" / "config.json"), torch.float32)  # control: nothing to change
    assert (tmp_path / "out" / "config.json").read_bytes() == before
    say_weights_dtype(str(tmp_path / "out" / "config.json"), torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
