"""load_hf: the mHC epsilon at every site, controls that prove the parity checks bite, sharded and in-memory
spellings of the checkpoint, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm53_ds
from glm53_ds.hf_loader import CheckpointError
from tests.model_fixtures import CONFIG_A, CONFIG_B, batch, load_hf_reference, rel_err, save_tiny_hf

PARITY = 1e-5
# rms_norm_eps far from hc_eps (1e-4) and from the usual 1e-6 default, at a magnitude where it changes the mHC norm.
EPS_CONFIG = dict(CONFIG_A, rms_norm_eps=2e-2, hc_eps=1e-4)


@pytest.fixture(scope="module")
def eps_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_eps")
    save_tiny_hf(path, EPS_CONFIG, seed=2)
    return path, load_hf_reference(path)


def _logit_error(model, hf, cfg_vocab=96):
    ids, mask, _ = batch(cfg_vocab, s=30, padding="left")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        out = model(ids, attention_mask=mask)
    return rel_err(out[mask], ref[mask])


def test_every_mhc_site_uses_rms_norm_eps(eps_checkpoint):
    path, hf = eps_checkpoint
    model = glm53_ds.load_hf(str(path)).eval()
    assert _logit_error(model, hf) <= PARITY
    dense = next(i for i, t in enumerate(EPS_CONFIG["mlp_layer_types"]) if t == "dense")
    sparse = next(i for i, t in enumerate(EPS_CONFIG["mlp_layer_types"]) if t == "sparse")
    sites = [(dense, "attn_hc"), (dense, "ffn_hc"), (sparse, "attn_hc"), (sparse, "ffn_hc")]
    for layer in model.decoder.layers:
        assert layer.attn_hc.norm_eps == layer.ffn_hc.norm_eps == EPS_CONFIG["rms_norm_eps"]
    # Control per site: that one site falling back to hc_eps (or a 1e-6 default) breaks parity.
    for index, site in sites:
        for wrong in (EPS_CONFIG["hc_eps"], 1e-6):
            module = getattr(model.decoder.layers[index], site)
            module.norm_eps = wrong
            try:
                assert _logit_error(model, hf) > 10 * PARITY, (index, site, wrong)
            finally:
                module.norm_eps = EPS_CONFIG["rms_norm_eps"]
    assert _logit_error(model, hf) <= PARITY


def test_control_wrong_layer_order_fails_parity(tmp_path):
    save_tiny_hf(tmp_path, CONFIG_B)
    hf = load_hf_reference(tmp_path)
    model = glm53_ds.load_hf(str(tmp_path)).eval()
    assert _logit_error(model, hf) <= PARITY
    # layers 1 and 2 have the same type (KDA + MoE): load them swapped
    state = model.state_dict()
    swapped = {}
    for k, v in state.items():
        for a, b in (("decoder.layers.1.", "decoder.layers.2."), ("decoder.layers.2.", "decoder.layers.1.")):
            if k.startswith(a):
                k = b + k[len(a) :]
                break
        swapped[k] = v
    model.load_state_dict(swapped)
    assert _logit_error(model, hf) > 1e-3


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_small")
    hf = save_tiny_hf(path, CONFIG_B, seed=4)
    return path, hf


def _copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(small_checkpoint, tmp_path):
    name = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    path = _copy(small_checkpoint[0], tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): " + name.replace(".", r"\.")):
        glm53_ds.load_hf(str(path))


def test_unexpected_tensor_is_named(small_checkpoint, tmp_path):
    name = "model.language_model.layers.0.self_attn.bogus_proj.weight"
    path = _copy(small_checkpoint[0], tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): " + name.replace(".", r"\.")):
        glm53_ds.load_hf(str(path))


def test_wrong_shape_names_key_and_shapes(small_checkpoint, tmp_path):
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    path = _copy(small_checkpoint[0], tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(16, 31)}))
    with pytest.raises(
        CheckpointError,
        match=name.replace(".", r"\.") + r": checkpoint shape \(16, 31\), expected \(16, 32\)",
    ):
        glm53_ds.load_hf(str(path))


def test_integer_bits_are_refused_naming_the_tensor(small_checkpoint, tmp_path):
    """Before: a tensor stored as int32 (float bits, say) was copied in as its integer values (loss 2e10, rc 0).
    Now the loader and the converter refuse it, naming it."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.convert.import_hf import ConversionError

    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    path = _copy(
        small_checkpoint[0], tmp_path / "ckpt", lambda t: t.update({name: t[name].view(torch.int32)})
    )
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + " is stored as int32"):
        glm53_ds.load_hf(str(path))
    with pytest.raises(ConversionError, match=name.replace(".", r"\.") + " is stored as int32"):
        hf_to_native(str(path), str(tmp_path / "native"))
    assert not (tmp_path / "native").exists()


def test_other_model_type_is_refused(small_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint[0], path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen3_next"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type='qwen3_next' is not a GLM-5.3 config"):
        glm53_ds.load_hf(str(path))


def test_sharded_checkpoint_with_index(small_checkpoint, tmp_path):
    _, hf = small_checkpoint
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = glm53_ds.load_hf(str(tmp_path)).eval()
    assert _logit_error(model, load_hf_reference(tmp_path)) <= PARITY


def test_in_memory_transformers_names_load(small_checkpoint, tmp_path):
    """A state dict in transformers' in-memory spelling (attn_hc.fn, fused conv1d / experts) loads the same."""
    path, hf = small_checkpoint
    shutil.copytree(path, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("attn_hc.fn") for k in state) and any(
        k.endswith("experts.gate_up_proj") for k in state
    )
    save_file(state, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    a = glm53_ds.load_hf(str(path)).state_dict()
    b = glm53_ds.load_hf(str(tmp_path / "ckpt")).state_dict()
    assert a.keys() == b.keys()
    for k in (k for k in a if not k.endswith("_extra_state")):
        assert torch.equal(a[k], b[k]), k
