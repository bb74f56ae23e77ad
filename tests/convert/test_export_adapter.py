"""`convert/export_adapter.py`: LoRA adapters as a PEFT adapter of transformers' glm5_next model, loaded by PEFT.

Round trip (fp32, CONFIG_A: KDA with its forget gate, MLA, dense MLP, MoE with a shared expert): our model with
random adapters on every target (B nonzero) vs `peft.PeftModel.from_pretrained(transformers' model, out)`: logits
max relative error <= 3e-5. The error is fp32 rounding of two evaluation orders and depends on the CPU's BLAS code
path: measured 6.2e-6 (AVX-512), 4.0e-6 (ATen AVX2), 6.6e-6 (no SIMD), 1.3e-5 with MKL restricted to AVX2
(`MKL_ENABLE_INSTRUCTIONS=AVX2`) and 1.42e-5 on the CI machine; the same model without adapters is 1.7e-6 against
transformers. The bound is twice the largest measured. Controls: the expert adapters left out, or their B columns
written expert-major instead of PEFT's rank-major order, miss by > 1e-3 (over 30x the bound).
Also: the MTP adapters and a dropout on the experts are announced, not dropped silently; a checkpoint without
adapters is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

import glm53_ds
from glm53_ds.convert.export_adapter import ADAPTER_CONFIG, native_to_peft, peft_adapter, write_peft_adapter
from glm53_ds.convert.import_hf import ConversionError
from glm53_ds.layers.lora import LoraSpec, is_lora_param
from glm53_ds.layers.lora_targets import apply_lora
from tests.model_fixtures import CONFIG_A, batch, load_hf_reference, rel_err, save_tiny_hf

RANK, ALPHA = 3, 6.0
PEFT_BOUND = 3e-5  # fp32 rounding over BLAS code paths: see the module docstring


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_peft")
    save_tiny_hf(path, CONFIG_A)
    ours = glm53_ds.load_hf(str(path)).eval()
    spec = LoraSpec(rank=RANK, alpha=ALPHA)
    apply_lora(ours, spec)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # trained-looking adapters: every B nonzero
        for name, p in ours.named_parameters():
            if is_lora_param(name):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    adapters = {n: p.detach().clone() for n, p in ours.named_parameters() if is_lora_param(n)}
    ids = batch(CONFIG_A["vocab_size"], s=20)[0]
    with torch.no_grad():
        logits = ours(ids)
    return path, adapters, spec, ids, logits


def _peft_logits(path, out, ids):
    model = PeftModel.from_pretrained(load_hf_reference(path), str(out)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_peft_gives_our_logits(tiny, tmp_path):
    path, adapters, spec, ids, logits = tiny
    tensors, config, notices = peft_adapter(
        adapters, glm53_ds.Glm53Config.from_text_dict(CONFIG_A), spec.record()
    )
    assert notices == [] and config["target_parameters"] == [
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ]
    write_peft_adapter(str(tmp_path / "peft"), tensors, config)
    assert json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())["r"] == RANK
    assert rel_err(_peft_logits(path, tmp_path / "peft", ids), logits) <= PEFT_BOUND

    # controls: the experts' adapters left out, or their B in the wrong column order
    without = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    write_peft_adapter(str(tmp_path / "no_experts"), without, dict(config, target_parameters=None))
    assert rel_err(_peft_logits(path, tmp_path / "no_experts", ids), logits) > 1e-3
    wrong = dict(tensors)
    for k, v in tensors.items():
        if ".mlp.experts." in k and k.endswith("lora_B.weight"):
            experts = CONFIG_A["n_routed_experts"]
            wrong[k] = v.reshape(v.shape[0], RANK, experts).transpose(1, 2).reshape(v.shape).contiguous()
    write_peft_adapter(str(tmp_path / "wrong"), wrong, config)
    assert rel_err(_peft_logits(path, tmp_path / "wrong", ids), logits) > 1e-3


def test_what_peft_cannot_hold_is_announced(tiny):
    _, adapters, spec, _, _ = tiny
    cfg = glm53_ds.Glm53Config.from_text_dict(CONFIG_A)
    mtp = {"mtp.0.transformer_layer.self_attention.o_proj.lora.A": torch.zeros(RANK, 4)}
    _, config, notices = peft_adapter({**adapters, **mtp}, cfg, dict(spec.record(), dropout=0.1))
    assert config["lora_dropout"] == 0.0
    assert any("MTP layer's 1 adapter tensors are left out" in n for n in notices)
    assert any("lora_dropout 0.1 written as 0" in n for n in notices)
    no_experts = {k: v for k, v in adapters.items() if ".experts." not in k}
    _, config, notices = peft_adapter(no_experts, cfg, dict(spec.record(), dropout=0.1))
    assert config["lora_dropout"] == 0.1 and config["target_parameters"] is None and notices == []


def test_a_checkpoint_without_adapters_is_refused(hf_dir, tmp_path):
    from glm53_ds.convert import hf_to_native

    native = hf_to_native(str(hf_dir), str(tmp_path / "native"))
    with pytest.raises(ConversionError, match="not a LoRA checkpoint"):
        native_to_peft(native, str(tmp_path / "out"))


def _rewrite(tag, name, make):
    """Replace stored tensor `name` of the tag's replicated set by `make(tensor)`; the manifest follows (a tag
    whose files are whole, holding the odd tensor)."""
    from safetensors.torch import load_file, save_file

    from glm53_ds.safe_io import describe_files, list_files, write_manifest

    shard = tag / "glm53" / "replicated-00001.safetensors"
    tensors = load_file(str(shard))
    tensors[name] = make(tensors[name])
    save_file(tensors, str(shard))
    write_manifest(str(tag), describe_files(str(tag), list_files(str(tag))))


@pytest.mark.parametrize(
    "case, make, message",
    [
        ("nan", lambda t: t.clone().fill_(float("nan")), "holds non-finite values"),
        ("int32 bits", lambda t: t.view(torch.int32).clone(), "is stored as int32"),
        ("wrong shape", lambda t: torch.zeros(t.shape[0] + 1, t.shape[1]), "has shape"),
    ],
)
def test_native_to_peft_refuses_adapters_it_cannot_export_truthfully(tmp_path, case, make, message):
    """Before: NaN adapters exported with rc 0; int32 bits read as values (3e9-sized floats); a wrong-shaped adapter
    a traceback. Now one error naming the tensor, nothing written."""
    import shutil

    from tests.model_fixtures import save_lora_native

    base = save_lora_native(tmp_path / "base", LoraSpec(rank=2, alpha=4.0, targets=("mla",)))
    native_to_peft(str(base), str(tmp_path / "ok"))  # the tag as saved exports
    tag = tmp_path / "ck" / "step1"
    shutil.copytree(base, tag)
    name = sorted(
        k for k in glm53_ds.convert.export_hf.NativeCheckpoint(str(tag)).keys() if k.endswith("lora.A")
    )[0]
    _rewrite(tag, name, make)
    with pytest.raises(ValueError, match=message) as error:
        native_to_peft(str(tag), str(tmp_path / "out"))
    assert name in str(error.value)
    assert not (tmp_path / "out").exists()
