"""The FLOP model (`glm53_ds/flops.py`): its parameter count is the planner's active count seen from the other side
(exact, tiny and released), its attention terms follow their definitions, and the trainer reports TFLOP/s per GPU
(MFU where the peak is known)."""

from __future__ import annotations

import pytest
import torch

from glm53_ds.flops import device_peak_tflops, matrix_parameters, mean_visible, step_flops
from glm53_ds.model import build_model
from glm53_ds.plan import count_parameters
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import preset


@pytest.mark.parametrize("name", ["tiny", "glm-5.3-flash"])
def test_the_matrices_are_the_active_parameters(name):
    """dense + routed x top-k / E + indexer - the second use of the output layer + the embedding + the 1-D
    parameters = the planner's active count, exactly (17,762,889,470 at the released size)."""
    cfg = preset(name)
    dense, routed, forward_only = matrix_parameters(cfg)
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.bfloat16, mtp=True, perform_initialization=False)
    small = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    rebuilt = (
        dense
        + routed
        + forward_only
        - model.output_layer.weight.numel()
        + model.embedding.weight.numel()
        + small
    )
    assert rebuilt == count_parameters(PlannedRun.for_model(cfg)).active


def test_the_attention_terms():
    assert [mean_visible(n, 3) for n in (1, 2, 3)] == [1.0, 1.5, 2.0]
    assert mean_visible(10, 3) == pytest.approx(sum(min(i + 1, 3) for i in range(10)) / 10)
    cfg = preset("glm-5.3-flash")
    short, long = step_flops(cfg, 4096), step_flops(cfg, 131072)
    assert short.matmul == long.matmul and short.kda == long.kda  # per token: independent of the length
    w = cfg.index_topk + cfg.index_kpool - 1
    dsa_layers = sum(t != "linear_attention" for t in cfg.layer_types) + 1  # + MTP
    attention = 12 * cfg.num_attention_heads * mean_visible(131072, w) * cfg.kv_lora_rank
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * mean_visible(131072, 131072) / cfg.index_kpool
    assert long.dsa == pytest.approx(dsa_layers * (attention + indexer))
    assert indexer < 0.05 * attention
    lora = step_flops(cfg, 4096, base_trained=False)
    assert lora.matmul < short.matmul and lora.dsa == short.dsa
    # 17.8B active: about 6 x 17.7e9 + attention per token
    assert 110e9 < short.per_token < 125e9


def test_peaks_by_device_name():
    assert device_peak_tflops("NVIDIA H200") == device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and device_peak_tflops("Tesla T4") is None
