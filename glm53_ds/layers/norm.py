"""RMSNorm with HF's numerics (`Glm5NextTextRMSNorm`): normalise in fp32, cast back, then scale by the weight.

Buildable by megatron (`build_module(spec, config=..., hidden_size=..., eps=...)`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..mhc import hc_head, unpack_streams


class RMSNorm(nn.Module):
    def __init__(
        self, config=None, hidden_size: int = 0, eps: float = 1e-6, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm needs hidden_size > 0, got {hidden_size}")
        param_dtype = dtype or (config.params_dtype if config is not None else torch.float32)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=param_dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class StreamMeanRMSNorm(RMSNorm):
    """The decoder's final norm (megatron's block `layer_norm`): the mean over the mHC streams (HF's `hc_head`),
    then RMSNorm. Takes the packed streams `[s*n, b, D]` (or `[s, b, n, D]`) and returns `[s, b, D]`, so a megatron
    `TransformerBlock` built from the GLM-5.3 spec hands `[s, b, D]` to the output layer as megatron expects."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps)
        self.hc_mult = config.glm.hc_mult

    def stream_mean(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head(unpack_streams(streams, self.hc_mult))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.stream_mean(streams))


class GatedRMSNorm(nn.Module):
    """KDA output norm (HF `Glm5NextTextRMSNormGated`): fp32 RMS norm, fp32 weight, times sigmoid(gate)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h
        return (h * torch.sigmoid(gate.float())).to(input_dtype)
