"""Glm53Config: reading released configs (nested, flat, dict, path), HF's defaults, and validation errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from glm53_ds.config import Glm53Config
from tests.hf_reference import TINY_TEXT as TINY_TEXT_BASE
from tests.hf_reference import VISION as TINY_VISION
from tests.hf_reference import hf_text_config

TINY_TEXT = dict(TINY_TEXT_BASE, rms_norm_eps=3e-5, hc_eps=2e-6, hc_mult=3)

# Fields whose value HF derives or exposes under another name; compared separately.
HF_COMPARED_FIELDS = [
    f.name
    for f in dataclasses.fields(Glm53Config)
    if f.name not in ("num_nextn_predict_layers", "mtp_loss_weight")
]


@pytest.fixture(scope="module")
def saved_hf_dir(tmp_path_factory):
    """A real `save_pretrained` directory of a tiny random Glm5NextForConditionalGeneration."""
    path = tmp_path_factory.mktemp("tiny_hf")
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TINY_TEXT, vision_config=TINY_VISION))
    model.save_pretrained(path)
    return path


def test_from_saved_directory_matches_hf_text_config(saved_hf_dir):
    cfg = Glm53Config.from_hf(saved_hf_dir)
    hf = Glm5NextConfig.from_pretrained(saved_hf_dir).text_config
    for name in HF_COMPARED_FIELDS:
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.rms_norm_eps == 3e-5 and cfg.hc_eps == 2e-6 and cfg.hc_mult == 3
    assert cfg.qk_head_dim == hf.qk_head_dim
    # config.json path and parsed dict give the same result
    assert Glm53Config.from_hf(saved_hf_dir / "config.json") == cfg
    assert Glm53Config.from_hf(json.loads((saved_hf_dir / "config.json").read_text())) == cfg


def test_flat_text_only_config():
    flat = dict(TINY_TEXT, model_type="glm5_next")
    cfg = Glm53Config.from_hf(flat)
    assert cfg.hidden_size == 32 and cfg.hc_mult == 3 and cfg.rms_norm_eps == 3e-5


def test_defaults_equal_hf_defaults():
    cfg = Glm53Config()
    hf_default = Glm5NextTextConfig()
    for name in HF_COMPARED_FIELDS:
        assert getattr(cfg, name) == getattr(hf_default, name), name
    assert cfg.mtp_loss_weight == 0.3 and cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize(
    "extra",
    [
        dict(index_topk_freq=2, index_skip_topk_offset=1),
        dict(index_topk_pattern="FSFS"),
        dict(
            linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=3, gate_lower_bound=None)
        ),
        dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    ],
)
def test_legacy_keys_are_read_like_hf(extra):
    text = dict(TINY_TEXT, **extra)
    # Adjacent indexed layers, so "shared" indexer entries are valid in both implementations.
    text.setdefault("layer_types", ["indexed_attention"] * 4)
    hf = hf_text_config(**text)
    cfg = Glm53Config.from_hf(dict(model_type="glm5_next", text_config=text))
    for name in ("indexer_types", "layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                 "linear_lower_bound"):  # fmt: skip
        assert getattr(cfg, name) == getattr(hf, name), name


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(hc_mult=0), "hc_mult"),
        (dict(index_topk=10, index_kpool=4), "index_topk"),
        (
            dict(layer_types=["linear_attention", "sliding", "linear_attention", "indexed_attention"]),
            "layer_types[1]",
        ),
        (dict(num_key_value_heads=1), "num_attention_heads"),
        (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types"),
        (dict(indexer_types=["full", "full", "full", "half"]), "indexer_types[3]"),
        (dict(indexer_types=["full", "full", "full", "shared"]), "indexer_types[3]"),
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(hc_sinkhorn_iters=0), "hc_sinkhorn_iters"),
        (dict(hidden_size=32.0), "hidden_size"),
        (dict(n_group=3), "n_routed_experts"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(q_lora_rank=None), "q_lora_rank"),
    ],
)
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Glm53Config.from_hf(dict(model_type="glm5_next", text_config=dict(TINY_TEXT, **change)))


def test_other_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_TEXT, model_type="deepseek_v3")))
    with pytest.raises(ValueError, match="model_type='deepseek_v3'"):
        Glm53Config.from_hf(tmp_path)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Glm53Config.from_hf(tmp_path)


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="hc_multi"):
        Glm53Config.from_hf(dict(TINY_TEXT, model_type="glm5_next"), hc_multi=2)


def test_the_transformer_config_says_no_deprecation():
    """Before: megatron's own default cuda_graph_scope ("full") made megatron warn `full scope is deprecated` on
    every run and conversion. Now the config passes its replacement (the same whole-layer scope); the control:
    megatron's default still warns."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    from glm53_ds.training.presets import tiny
    from glm53_ds.transformer_config import make_transformer_config

    def scope_warnings(make) -> list[str]:  # type: ignore[no-untyped-def]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        return [str(w.message) for w in caught if "scope is deprecated" in str(w.message)]

    assert scope_warnings(lambda: make_transformer_config(tiny())) == []
    assert scope_warnings(lambda: TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1))
