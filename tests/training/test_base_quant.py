"""`--base-quant` and `--export-format` as shipped (`python launch/train.py`, one CPU rank) on a tiny FP8 download
that the test makes (`save_fp8_copy`: block-FP8 experts with 16 x 16 blocks, partial edge blocks included): the
FP8-resident run trains as the dequantised one does, says how it keeps its base, refuses what it cannot keep, and
exports the merged model dense (loadable by transformers) or requantised to the released layout."""

from __future__ import annotations

import json
import re

import pytest
import torch

import glm53_ds
from tests.cli import metrics, one_error, run, tiny_hf_checkpoint

BASE = ["--train-iters", "3", "--seq-length", "32", "--global-batch-size", "2", "--tokenizer", "bytes"]
LORA = ["--lora-rank", "4"]  # on every target kind, the experts too


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> tuple[str, str]:
    """(the tiny model in bf16 as a released checkpoint, the same as the FP8 download stores it)."""
    from tests.model_fixtures import save_fp8_copy

    root = tmp_path_factory.mktemp("releases")
    tiny_hf_checkpoint(root / "bf16")
    return str(root / "bf16"), str(save_fp8_copy(root / "bf16", root / "fp8", (16, 16)))


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_fp8_resident_trains_as_the_dequantised_base_and_exports_either_way(tmp_path, releases):
    _, fp8 = releases
    kept = _ok(run("--hf-dir", fp8, *BASE, *LORA, "--output-dir", str(tmp_path / "kept"), "--export-hf",
                   str(tmp_path / "dense"), "--export-adapter", str(tmp_path / "adapter")))  # fmt: skip
    assert re.search(r"base: routed experts.* kept in block-FP8 16x16 as stored.*\(--base-quant auto\)", kept)
    assert re.search(r"exported \S+dense \(transformers layout, \w+, dense, LoRA merged", kept)
    dequantised = _ok(run("--hf-dir", fp8, *BASE, *LORA, "--base-quant", "none", "--output-dir",
                          str(tmp_path / "none")))  # fmt: skip
    assert "dequantised at load (--base-quant none)" in dequantised
    # the same computation: the dequantised model's (the CPU path dequantises the same values tile by tile)
    losses = [r["lm_loss"] for r in metrics(tmp_path / "kept")]
    assert losses == [r["lm_loss"] for r in metrics(tmp_path / "none")], (losses, metrics(tmp_path / "none"))

    # the dense export: no quantization_config (a loader would read its bf16 weights as FP8), transformers loads it
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    from transformers import Glm5NextForConditionalGeneration

    hf = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "dense", attn_implementation="eager",
                                                          dtype=torch.float32).eval()  # fmt: skip
    ours = glm53_ds.load_hf(str(tmp_path / "dense")).eval()
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense_logits = ours(ids)
        torch.testing.assert_close(hf(input_ids=ids).logits, dense_logits, rtol=1e-4, atol=1e-4)

    # the FP8 export: the released layout (FP8 + weight_scale_inv, its quantization_config), the error said
    requantised = _ok(run("--hf-dir", fp8, *BASE, *LORA, "--train-iters", "1", "--output-dir", str(tmp_path / "q"),
                          "--export-hf", str(tmp_path / "fp8_export"), "--export-format", "fp8"))  # fmt: skip
    said = re.search(r"block-FP8 as released, (\d+) tensors requantised to block-FP8 16x16: relative error vs the "
                     r"dense merge (\S+) overall", requantised)  # fmt: skip
    assert said and int(said.group(1)) > 0 and 0 < float(said.group(2)) < 0.1, requantised[-2000:]
    summary = [line for line in requantised.splitlines() if line.startswith("run: ")]
    assert summary and "exported " in summary[-1] and "relative error vs the dense merge" in summary[-1], (
        summary
    )
    config = json.loads((tmp_path / "fp8_export" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 16]
    from glm53_ds.convert.import_hf import HFSource

    source = HFSource(str(tmp_path / "fp8_export"))
    stored = [n for n in source.weight_map if n.endswith("experts.0.down_proj.weight")]
    assert stored and source.dtype(stored[0]) == torch.float8_e4m3fn
    assert stored[0][: -len("weight")] + "weight_scale_inv" in source.weight_map
    reloaded = glm53_ds.load_hf(str(tmp_path / "fp8_export")).eval()
    with torch.no_grad():
        assert torch.isfinite(reloaded(ids)).all()


def test_what_cannot_be_kept_in_fp8_is_refused_in_one_line(tmp_path, releases):
    bf16, fp8 = releases
    out = ["--output-dir", str(tmp_path / "run")]
    error = one_error(run("--hf-dir", bf16, *BASE, *LORA, "--base-quant", "fp8", *out))
    assert "--base-quant fp8" in error and "stores no weights in block-FP8" in error
    error = one_error(run("--hf-dir", fp8, *BASE, "--base-quant", "fp8", *out))  # full fine-tuning
    assert "--base-quant fp8" in error and "full fine-tuning trains every weight" in error
    error = one_error(run("--hf-dir", bf16, *BASE, *LORA, "--export-hf", str(tmp_path / "x"), "--export-format",
                          "fp8", *out))  # fmt: skip
    assert "--export-format fp8" in error and "no weights in block-FP8" in error
    assert not (tmp_path / "x").exists()


def test_a_resume_keeping_the_base_another_way_is_announced_and_continues_exactly(tmp_path, releases):
    _, fp8 = releases
    _ok(run("--hf-dir", fp8, *BASE, *LORA, "--save", str(tmp_path / "ck"), "--save-interval", "2", "--output-dir",
            str(tmp_path / "a")))  # fmt: skip
    said = _ok(run("--hf-dir", fp8, *BASE, *LORA, "--load", str(tmp_path / "ck"), "--load-tag", "step2",
                   "--base-quant", "none", "--save", str(tmp_path / "ck2"), "--output-dir", str(tmp_path / "b")))  # fmt: skip
    assert ("--base-quant: the checkpoint's run kept its base block-fp8, this run keeps it dense (the same values: "
            "the dequantised base's)") in said  # fmt: skip
    # an adapter checkpoint: the base kept in FP8 is reloaded from its source, never saved (before: every rank's
    # FP8 experts in it, which DeepSpeed's load then copied, raw, into the dense weights of a `none` resume)
    from safetensors import safe_open

    for file in (tmp_path / "ck" / "step2" / "glm53").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            assert not [k for k in f.keys() if "scale_inv" in k or "float8" in str(f.get_slice(k).get_dtype()).lower()
                        or f.get_slice(k).get_dtype() == "F8_E4M3"], file  # fmt: skip
    # the same values: step 3 after the resume is the uninterrupted run's step 3, bitwise
    assert [r["lm_loss"] for r in metrics(tmp_path / "b")] == [r["lm_loss"] for r in metrics(tmp_path / "a")][
        2:
    ]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--ep", "2", "--sp", "2"), ("--etp", "2")], ids=["ep2-sp2", "etp2"])
def test_two_ranks_train_the_single_process_curve_and_resume_on_one(tmp_path, releases, layout):
    """The FP8 base at EP 2 x SP 2 (each row split over both ranks, the experts sharded over the same two) or
    ETP 2 (each expert's rows split, blocks cut inside) gives the single-process dequantised run's losses, the
    replicas checked every step; its checkpoint resumes on one rank (another layout), FP8 kept."""
    from tests.cli import deepspeed_run

    _, fp8 = releases
    common = [
        *BASE,
        *LORA,
        "--hf-dir",
        fp8,
        "--lr",
        "1e-2",
        "--check-replicas-interval",
        "1",
        "--micro-batch-size",
        "1",
    ]
    proc = deepspeed_run(2, *common, *layout, "--save", str(tmp_path / "ck"), "--save-interval", "2",
                         "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "kept in block-FP8 16x16 as stored" in proc.stdout + proc.stderr
    one = _ok(run(*common, "--base-quant", "none", "--output-dir", str(tmp_path / "one")))
    assert "dequantised at load" in one
    for x, y in zip(metrics(tmp_path / "a"), metrics(tmp_path / "one"), strict=True):
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 * abs(y["lm_loss"]), (x, y)
    _ok(run(*common, "--load", str(tmp_path / "ck"), "--load-tag", "step2", "--save", str(tmp_path / "ck1"),
            "--output-dir", str(tmp_path / "b")))  # fmt: skip
    (x,), (y,) = metrics(tmp_path / "b"), metrics(tmp_path / "a")[2:]
    assert x["step"] == y["step"] == 3 and abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 * abs(y["lm_loss"]), (
        x,
        y,
    )
