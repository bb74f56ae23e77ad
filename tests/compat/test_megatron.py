"""glm53_ds/compat/megatron.py: the differences between the megatron-core releases glm53_ds runs with live there
only, and each answer matches what the installed megatron does (CI: 0.16.1; `tools/megatron_compat.sh 0.19.2`
runs this file under 0.19.2)."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from glm53_ds import get_glm53_block_spec, get_glm53_mtp_block_spec, make_transformer_config
from glm53_ds.compat import megatron as compat
from glm53_ds.config import Glm53Config
from tests.model_fixtures import CONFIG_A

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "glm53_ds")
VERSION_CHECKS = re.compile(r"megatron\.core\.__version__|MEGATRON_VERSION|version\(\s*['\"]megatron")


def test_no_module_but_the_compat_module_asks_megatrons_version():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not path.endswith(os.path.join("compat", "megatron.py")):
                text = open(path, encoding="utf-8").read()
                found += [f"{path}: {m.group(0)}" for m in VERSION_CHECKS.finditer(text)]
    assert found == []
    # control: the pattern finds the compat module's own
    assert VERSION_CHECKS.search(
        open(os.path.join(PACKAGE, "compat", "megatron.py"), encoding="utf-8").read()
    )


def test_the_configs_cuda_graph_field_raises_no_deprecation_warning():
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_transformer_config(cfg)
    said = [
        str(w.message) for w in caught if "cuda_graph" in str(w.message) or "full scope" in str(w.message)
    ]
    assert said == []
    # control: the other release's spelling warns on this one
    other = {"cuda_graph_scope": []} if "cuda_graph_modules" in compat.cuda_graph_whole_layer() else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_transformer_config(cfg, **other) if other else _megatron_default(cfg)
    assert any("cuda_graph" in str(w.message) or "full scope" in str(w.message) for w in caught)


def _megatron_default(cfg: Glm53Config) -> None:
    """A config with megatron's own default scope ("full"), which 0.16.1 deprecates."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


def test_gpt_model_mtp_without_the_config_fields_is_what_the_flag_says():
    cfg = Glm53Config.from_text_dict({**CONFIG_A, "num_nextn_predict_layers": 1})
    model = GPTModel(make_transformer_config(cfg, torch.float32), get_glm53_block_spec(cfg), cfg.vocab_size, 30,
                     position_embedding_type="none", mtp_block_spec=get_glm53_mtp_block_spec(cfg))  # fmt: skip
    built = getattr(model, "mtp_process", False)
    assert built is not compat.GPT_MODEL_NEEDS_MTP_FIELDS
    with_fields = GPTModel(make_transformer_config(cfg, torch.float32, mtp=True), get_glm53_block_spec(cfg),
                           cfg.vocab_size, 30, position_embedding_type="none",
                           mtp_block_spec=get_glm53_mtp_block_spec(cfg))  # fmt: skip
    assert with_fields.mtp_process  # the documented way builds it on every release


@pytest.mark.parametrize("name", compat.__all__)
def test_every_listed_difference_is_in_the_table(name):
    doc = compat.__doc__ or ""
    assert name == "MEGATRON_VERSION" or f"`{name}" in doc
