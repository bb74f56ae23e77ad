"""One slice of the released model at its real widths against transformers on CPU: two layers (one KDA, one
DSA/MLA), hidden 4096, 64 heads of each attention kind with the released head dims (NoPE MLA 256 / 256,
kv_lora_rank 512, q_lora_rank 1536, the indexer's 32 heads x 128), 8 routed experts of the released width (2048)
plus the shared expert, mHC with 4 streams; forward and backward (734M parameters; the vocabulary cut to 2,048 and
index_topk to half the tokens so that the DSA selection is sparse at this length). A shape or an index that only
the released dims reach shows here, not on a cluster.

Tolerances (fp32): loss and logits <= 1e-5 relative, every gradient <= 1e-4 relative to its tensor's largest entry
(the whole-model parity bounds of tests/test_model.py). 256 tokens in CI, index_topk half of them
(GLM53_REAL_WIDTH_TOKENS sets another length; 512 took 149 s of CI's time, 256 takes 77 s): transformers' reference
KDA and eager attention hold 10 GB of activations at 1,024 tokens (20 GB at the peak of this test, too close to a
24 GB CI machine). Measured at 1,024 tokens (index_topk 512): loss bitwise, logits 1.2e-6, every gradient within
the bound.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.training.presets import glm53_flash
from tests.model_fixtures import (
    check_grads_against_hf,
    hf_grads_by_native,
    load_hf_reference,
    rel_err,
    save_tiny_hf,
)

SLICE = {
    k: v
    for k, v in glm53_flash().to_text_dict().items()
    if k not in ("model_type", "qk_head_dim", "head_dim")
}
SLICE.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
             mlp_layer_types=["sparse", "sparse"], indexer_types=["full", "full"], n_routed_experts=8,
             num_experts_per_tok=2, vocab_size=2048, pad_token_id=2047, num_nextn_predict_layers=0,
             max_position_embeddings=4096)  # fmt: skip
TOKENS = int(os.environ.get("GLM53_REAL_WIDTH_TOKENS", "256"))
SLICE["index_topk"] = TOKENS // 2  # sparse at this length


@pytest.mark.slow
def test_a_real_width_slice_matches_transformers(tmp_path):
    cfg = Glm53Config.from_text_dict(SLICE)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.linear_num_heads, cfg.moe_intermediate_size) == (
        4096, 64, 64, 2048)  # fmt: skip
    save_tiny_hf(tmp_path, SLICE, hf_init=False)
    ids = torch.randint(1, SLICE["vocab_size"] - 1, (1, TOKENS), generator=torch.Generator().manual_seed(0))

    hf = load_hf_reference(tmp_path)
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_loss, ref_logits = ref.loss.detach(), ref.logits.detach()
    ref_grads = hf_grads_by_native(hf, cfg)  # views of HF's gradients: the model itself is freed below
    del hf, ref
    gc.collect()

    ours = glm53_ds.load_hf(str(tmp_path))
    ours.train()
    loss = ours(ids, labels=ids)
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) <= 1e-5
    assert check_grads_against_hf(ours, ref_grads) > 40
    del ref_grads
    ours.zero_grad(set_to_none=True)
    ours.eval()
    with torch.no_grad():
        assert rel_err(ours(ids), ref_logits) <= 1e-5
