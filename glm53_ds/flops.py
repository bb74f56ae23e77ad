"""The FLOP model of a training step, for TFLOP/s and MFU (docs/numerics.md, "The FLOP model").

Per token of a row of L tokens, forward + backward (training = 3 x forward for everything that trains):

    matmuls    6 x (dense matrix parameters + routed-expert matrix parameters x top-k / experts)
               + 2 x the DSA indexers' matrix parameters (frozen: forward only);
               every weight matrix of the model with the MTP layer, the output layer counted once per head
               that uses it (LM + MTP), the input embedding not (a lookup); MLA in the absorbed form costs what
               its kv_b_proj costs (q_lat = W_UK^T q, out = W_UV o_lat: one use of each half per token and head)
    DSA        3 x 4 H W_eff R per DSA layer (scores q_lat c^T and p c over the W_eff latent rows a query
               attends: W_eff = the mean of min(i + 1, W) over its positions i), + 2 Hi Di P_eff for the
               indexer's scores over the k-pools (forward only: the indexer is frozen; P_eff = the mean visible
               pools), + the MTP layer's attention alike
    KDA        3 x heads x (6 C dk + 4 C dv + 6 dk dv) per KDA layer (the chunked gated delta rule at chunk
               C = 64: A = k k^T, w = A k, u = A v, q k^T, attention x values within the chunk; w S, q S and the
               state update across chunks)
    LoRA       the frozen base's matrices 4 x instead of 6 x (no weight gradient); the adapters' own FLOPs left out
    MFU        achieved model FLOP/s / the GPU's dense bf16 peak (989 TFLOP/s for H100 / H200 SXM)

A packed row's documents attend within themselves: W_eff is counted over the row (an upper bound; documents
shorter than W attend to fewer slots). The model is an estimate of useful work, not of what the kernels issue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Glm53Config
from .model import build_model

H100_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H100 / H200 SXM (no sparsity)
KDA_CHUNK = 64


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of one training step's forward + backward, by part."""

    matmul: float
    dsa: float
    kda: float

    @property
    def per_token(self) -> float:
        return self.matmul + self.dsa + self.kda

    def tflops(self, tokens_per_s: float) -> float:
        """TFLOP/s at this many tokens per second."""
        return self.per_token * tokens_per_s / 1e12


def matrix_parameters(cfg: Glm53Config, mtp: bool = True) -> tuple[int, int, int]:
    """(dense, routed-expert, forward-only) matrix parameters used per token: the whole model built on the meta
    device (no memory), its 2-D+ weights; the routed experts' scaled by top-k / experts; the output layer once per
    head; the DSA indexers' apart (frozen: forward only)."""
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.bfloat16, mtp=mtp, perform_initialization=False)
    dense = routed = forward_only = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("embedding."):
            continue
        if ".mlp.experts." in name:
            routed += p.numel()
        elif ".indexer." in name:
            forward_only += p.numel()
        else:
            dense += p.numel()
    heads = 1 + (cfg.num_nextn_predict_layers if mtp and model.mtp is not None else 0)
    dense += (heads - 1) * model.output_layer.weight.numel()
    return dense, routed * cfg.num_experts_per_tok // cfg.n_routed_experts, forward_only


def mean_visible(length: int, width: int) -> float:
    """The mean of min(i + 1, width) over positions i < length: the slots a causal query attends on average."""
    if length <= width:
        return (length + 1) / 2
    return (width * (width + 1) / 2 + (length - width) * width) / length


def step_flops(cfg: Glm53Config, seq_length: int, mtp: bool = True, base_trained: bool = True) -> StepFlops:
    """The FLOP model (module docstring) of `cfg` at rows of `seq_length` tokens. `base_trained=False` (LoRA: the
    base frozen): its matrices cost 4 x parameters (forward and the input gradient, no weight gradient)."""
    dense, routed, forward_only = matrix_parameters(cfg, mtp)
    slots = cfg.index_topk + cfg.index_kpool - 1
    dsa_layers = sum(t != "linear_attention" for t in cfg.layer_types) + (
        cfg.num_nextn_predict_layers if mtp else 0
    )
    kda_layers = sum(t == "linear_attention" for t in cfg.layer_types)
    w_eff = mean_visible(seq_length, slots)
    pools = mean_visible(seq_length, seq_length) / cfg.index_kpool
    dsa = dsa_layers * (3 * 4 * cfg.num_attention_heads * w_eff * cfg.kv_lora_rank
                        + 2 * cfg.index_n_heads * cfg.index_head_dim * pools)  # fmt: skip
    dk = dv = cfg.linear_head_dim
    kda = kda_layers * 3 * cfg.linear_num_heads * (6 * KDA_CHUNK * dk + 4 * KDA_CHUNK * dv + 6 * dk * dv)
    per_parameter = 6.0 if base_trained else 4.0
    return StepFlops(
        matmul=per_parameter * (dense + routed) + 2.0 * forward_only, dsa=float(dsa), kda=float(kda)
    )


# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by the device name CUDA reports
PEAK_TFLOPS = {"H100": H100_BF16_TFLOPS, "H200": H100_BF16_TFLOPS, "H800": H100_BF16_TFLOPS, "A100": 312.0,
               "A800": 312.0, "B200": 2250.0, "GB200": 2500.0}  # fmt: skip


def device_peak_tflops(name: str) -> float | None:
    """The bf16 peak of a GPU by its name (`torch.cuda.get_device_name()`), None when unknown."""
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name.upper()), None)
