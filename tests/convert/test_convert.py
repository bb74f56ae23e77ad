"""Checkpoint conversion: bitwise round trips for several EP x ETP layouts (MTP and vision included),
transformers loading the export, glm53_ds loading the native layout, FP8 import, streaming memory, errors."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm53_ds
from glm53_ds.convert import hf_to_native, native_to_hf, verify
from glm53_ds.convert.export_hf import load_native
from glm53_ds.convert.fp8 import quantize_fp8
from glm53_ds.convert.import_hf import ConversionError
from tests.cli import ROOT, module_run
from tests.model_fixtures import CONFIG_A, add_mtp_tensors, load_hf_reference, rel_err, save_tiny_hf


def _all_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in glob.glob(os.path.join(directory, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_with_mtp(tmp_path_factory):
    """save_pretrained output (text + vision) plus MTP tensors under their released names."""
    path = tmp_path_factory.mktemp("conv_hf")
    save_tiny_hf(path, CONFIG_A)
    add_mtp_tensors(path, seed=9)
    return path


@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_round_trip_is_bitwise(hf_with_mtp, tmp_path, ep, etp):
    native = hf_to_native(str(hf_with_mtp), str(tmp_path / "native"), ep=ep, etp=etp)
    shards = sorted(os.path.basename(p) for p in glob.glob(f"{native}/hf/glm53/experts_*.index.json"))
    assert shards == [f"experts_ep{e:03d}_etp{t:03d}.index.json" for e in range(ep) for t in range(etp)]
    out = native_to_hf(native, str(tmp_path / "hf2"), hf_template=str(hf_with_mtp))
    before, after = _all_tensors(hf_with_mtp), _all_tensors(out)
    assert set(before) == set(after)
    assert any(k.startswith("model.visual.") for k in after) and any(".layers.6.eh_proj" in k for k in after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert (hf_with_mtp / "config.json").read_text() == (tmp_path / "hf2" / "config.json").read_text()
    assert verify(str(hf_with_mtp), native, out=lambda *_: None) == 0.0


def test_transformers_loads_the_export_and_native_loads_in_glm53(hf_with_mtp, tmp_path):
    native = hf_to_native(str(hf_with_mtp), str(tmp_path / "native"), ep=2, etp=2)
    out = native_to_hf(native, str(tmp_path / "hf2"), hf_template=str(hf_with_mtp))
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        original = load_hf_reference(hf_with_mtp)(input_ids=ids).logits
        exported = load_hf_reference(out)(input_ids=ids).logits
        from_native = load_native(native).eval()(ids)
        via_load_hf = glm53_ds.load_hf(str(hf_with_mtp)).eval()(ids)
    assert torch.equal(original, exported)
    assert torch.equal(from_native, via_load_hf)
    assert rel_err(from_native, original) <= 1e-5


@pytest.mark.slow
def test_cli_and_existing_output(hf_with_mtp, tmp_path):
    native, hf2 = str(tmp_path / "native"), str(tmp_path / "hf2")
    assert module_run("glm53_ds.convert", "hf-to-native", "--hf-dir", str(hf_with_mtp), "--out", native,
                      "--ep", "2").returncode == 0  # fmt: skip
    proc = module_run("glm53_ds.convert", "hf-to-native", "--hf-dir", str(hf_with_mtp), "--out", native)
    assert proc.returncode == 2 and "exists and is not empty; refusing to overwrite" in proc.stderr
    assert module_run("glm53_ds.convert", "native-to-hf", "--ckpt", native, "--out", hf2, "--hf-template",
                      str(hf_with_mtp)).returncode == 0  # fmt: skip
    proc = module_run("glm53_ds.convert", "verify", "--hf-dir", str(hf_with_mtp), "--ckpt", native)
    assert proc.returncode == 0 and "max difference: 0" in proc.stdout


def _edit(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.language_model.layers.3.mlp.experts.2.down_proj.weight"),
         r"missing 1 tensor\(s\): model\.language_model\.layers\.3\.mlp\.experts\.2\.down_proj\.weight"),
        (lambda t: t.update({"model.language_model.layers.1.self_attn.extra.weight": torch.zeros(2)}),
         r"unexpected 1 tensor\(s\): model\.language_model\.layers\.1\.self_attn\.extra\.weight"),
        (lambda t: t.update({"model.language_model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 30)}),
         r"model\.language_model\.layers\.0\.self_attn\.q_proj\.weight: checkpoint shape \(16, 30\), expected \(16, 32\)"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_named(hf_with_mtp, tmp_path, edit, message):
    src = _edit(hf_with_mtp, tmp_path / "bad", edit)
    with pytest.raises(ConversionError, match=message):
        hf_to_native(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_expert_count_not_divisible_by_ep(hf_with_mtp, tmp_path):
    with pytest.raises(ConversionError, match=r"--ep 3: n_routed_experts \(8\) is not divisible by EP=3"):
        hf_to_native(str(hf_with_mtp), str(tmp_path / "out"), ep=3)


def _fp8_copy(src, dst, bad_scale: bool = False) -> dict[str, torch.Tensor]:
    """Quantise every 2-D projection weight to FP8 with 128x128 block scales (the release convention)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    expected = {}
    for name in list(tensors):
        t = tensors[name]
        if name.startswith("model.language_model.") and name.endswith("proj.weight") and t.dim() == 2:
            q, s = quantize_fp8(t)
            if bad_scale:
                s = s.repeat(1, 2)
            tensors[name], tensors[name[: -len(".weight")] + ".weight_scale_inv"] = q, s
            # independent dequantisation: every element times its block's scale
            ref = torch.empty(t.shape)
            for i in range(t.shape[0]):
                for j in range(0, t.shape[1]):
                    ref[i, j] = q[i, j].float() * s[i // 128, j // 128] if not bad_scale else 0
            expected[name] = ref
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def test_fp8_import(hf_with_mtp, tmp_path):
    expected = _fp8_copy(hf_with_mtp, tmp_path / "fp8")
    native = hf_to_native(str(tmp_path / "fp8"), str(tmp_path / "native"), dtype=torch.float32)
    model = load_native(native)
    state = model.state_dict()
    q = expected["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(
        state["decoder.layers.0.self_attn.q_proj.weight".replace("self_attn", "self_attention")], q
    )
    gate = expected["model.language_model.layers.3.mlp.experts.5.gate_proj.weight"]
    assert torch.equal(state["decoder.layers.3.mlp.experts.gate_up_proj"][5, : gate.shape[0]], gate)
    # the dequantised model is close to the original (FP8 rounding), as a sanity check of the convention
    original = glm53_ds.load_hf(str(hf_with_mtp)).state_dict()[
        "decoder.layers.0.self_attention.q_proj.weight"
    ]
    assert rel_err(state["decoder.layers.0.self_attention.q_proj.weight"], original) < 0.1


def test_unknown_fp8_scale_layout_is_refused(hf_with_mtp, tmp_path):
    _fp8_copy(hf_with_mtp, tmp_path / "fp8", bad_scale=True)
    with pytest.raises(
        ValueError, match=r"unknown FP8 scale layout: weight_scale_inv has shape \(1, 2\), expected \(1, 1\)"
    ):
        hf_to_native(str(tmp_path / "fp8"), str(tmp_path / "native"))


BIG = dict(CONFIG_A, hidden_size=256, moe_intermediate_size=256, intermediate_size=512, n_routed_experts=32,
           num_experts_per_tok=2, num_hidden_layers=12, layer_types=CONFIG_A["layer_types"] * 2,
           indexer_types=CONFIG_A["indexer_types"] * 2, mlp_layer_types=["dense"] * 2 + ["sparse"] * 10)  # fmt: skip

_MEASURE = """
import sys, torch
from safetensors.torch import load_file
from benchmarks.measure import PeakRss
from glm53_ds.convert import hf_to_native
import glm53_ds.model, glm53_ds.convert.import_hf as m  # imports belong to the baseline
from glm53_ds.config import Glm53Config
m.expected_native_shapes(Glm53Config.from_hf(sys.argv[2]), False)  # the model definition (no weights) too
m.expected_native_shapes(Glm53Config.from_hf(sys.argv[2]), True)
with PeakRss() as rss:
    if sys.argv[1] == "convert":
        hf_to_native(sys.argv[2], sys.argv[3], ep=2, etp=2, shard_bytes=int(sys.argv[4]))
    else:  # control: what a non-streaming converter holds
        everything = load_file(sys.argv[2] + "/model.safetensors")
        sum(t.float().sum() for t in everything.values())
print(rss.extra)
"""


@pytest.mark.slow
def test_streaming_peak_memory(tmp_path):
    """Peak RSS over the baseline (interpreter, libraries and the weight-less model definition) stays within
    2 x (largest tensor + output shard size) for a checkpoint far larger than that bound; a non-streaming load
    measured the same way exceeds it (control)."""
    save_tiny_hf(tmp_path / "hf", BIG)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    largest_native = 16 * 256 * 256 * 4  # one shard's stacked gate_up of one layer (16 experts x 2*128 x 256)
    shard = 4 << 20
    bound = 2 * (max(largest, largest_native) + shard)
    assert total > 10 * bound
    del tensors
    # glibc raises its mmap threshold after freeing large blocks and then keeps freed heap memory mapped; with
    # a fixed threshold RSS reflects what the converter holds (at real sizes tensors are above any threshold).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}

    def peak_extra(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _MEASURE, mode, str(tmp_path / "hf"), str(tmp_path / mode), str(shard)],
                             cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout.split()  # fmt: skip
        return int(out[-1])

    extra = peak_extra("convert")
    assert extra <= bound, (
        f"peak extra {extra / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB (total {total / 2**20:.0f} MiB)"
    )
    control = peak_extra("load_all")  # the measurement sees a non-streaming load
    assert control > 10 * bound, f"control {control / 2**20:.1f} MiB"


def test_describe_reports_layout_and_completeness(hf_with_mtp, tmp_path, capsys):
    """`describe` names the layout a checkpoint was written at and checks every file against the manifest; a
    truncated expert shard makes it fail, naming the file (the control)."""
    from glm53_ds.convert.__main__ import main as convert_main

    native = hf_to_native(str(hf_with_mtp), str(tmp_path / "native"), ep=2, etp=2)
    assert convert_main(["describe", native]) == 0
    report = capsys.readouterr().out
    assert "EP 2, ETP 2, model only" in report and "4/4 expert shards" in report and "complete" in report
    shard = next(p for p in (tmp_path / "native").rglob("experts_ep001_etp000*") if p.is_file())
    shard.write_bytes(shard.read_bytes()[:-8])
    assert convert_main(["describe", native]) == 1
    report = capsys.readouterr().out
    assert "INCOMPLETE" in report and f"{shard.name} has" in report
