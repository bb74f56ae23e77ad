"""KDA linear attention layer (3 of every 4 GLM-5.3 layers), HF `Glm5NextTextLinearAttention` semantics.

x [s, b, D] -> padding tokens zeroed -> q/k/v projections -> causal depthwise short conv + SiLU (per q, k, v:
the released checkpoint stores `q_conv1d`/`k_conv1d`/`v_conv1d`) -> per-channel forget gate g (log decay)
and write strength beta = sigmoid(b_proj x) -> chunked delta rule (fp32) -> gated RMSNorm with
g_b(g_a(x)) -> o_proj -> [s, b, D].

Forget gate: f = f_b(f_a(x)) + dt_bias, A = exp(A_log) per head; with `linear_lower_bound` L:
g = L * sigmoid(A * f) (in [L, 0]); without it: g = -A * softplus(f) (softplus taken as f above 20).
`A_log`, `dt_bias` and the convolutions are fp32 parameters whatever the model dtype (HF keeps them fp32).
Packed documents restart the conv window and the state; under sequence parallelism the conv and the delta rule run
on all tokens of H/N heads after an all-to-all (`KimiDeltaAttention.forward`, parallel/sequence.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sequence import SequenceParallel
from ..transformer_config import Glm53TransformerConfig
from .documents import Documents
from .kda_ops import kda_attention
from .linear import ColumnLinear, RowLinear
from .norm import GatedRMSNorm


class ForgetGate(nn.Module):
    def __init__(self, config: Glm53TransformerConfig) -> None:
        super().__init__()
        cfg = config.glm
        self.head_dim = cfg.linear_head_dim
        self.num_heads = cfg.linear_num_heads
        key_dim = self.head_dim * self.num_heads
        self.f_a_proj = ColumnLinear(config, cfg.hidden_size, self.head_dim)
        self.f_b_proj = ColumnLinear(config, self.head_dim, key_dim)
        self.dt_bias = nn.Parameter(torch.empty(key_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.lower_bound = cfg.linear_lower_bound
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # HF / FLA init: A_log = 0 with the safe lower bound, else log U(1, 16); dt = exp(U(log 1e-3, log 1e-1))
        # stored as its inverse softplus.
        with torch.no_grad():
            if self.lower_bound is not None:
                self.A_log.zero_()
            else:
                self.A_log.uniform_(1.0, 16.0).log_()
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, D] -> g [b, s, H, dk] fp32 (log decay, <= 0)."""
        f = self.f_b_proj(self.f_a_proj(x))
        f = (f.float() + self.dt_bias.float()).unflatten(-1, (self.num_heads, self.head_dim))
        decay_rate = self.A_log.float().exp()[:, None]  # [H, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(decay_rate * f)
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        return -decay_rate * softplus


class KimiDeltaAttention(nn.Module):
    def __init__(
        self, config: Glm53TransformerConfig, layer_number: int = 1, pg_collection: Any = None, **unused: Any
    ) -> None:
        super().__init__()
        cfg = config.glm
        self.layer_number = layer_number
        self.num_heads = cfg.linear_num_heads
        self.head_dim = cfg.linear_head_dim
        key_dim = self.num_heads * self.head_dim
        hidden = cfg.hidden_size
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.kda_impl = config.kda_impl

        self.q_proj = ColumnLinear(config, hidden, key_dim)
        self.k_proj = ColumnLinear(config, hidden, key_dim)
        self.v_proj = ColumnLinear(config, hidden, key_dim)
        # Depthwise causal convolutions, fp32 as HF keeps them: weight [C, 1, kernel].
        self.q_conv1d = _depthwise_conv(key_dim, self.kernel_size)
        self.k_conv1d = _depthwise_conv(key_dim, self.kernel_size)
        self.v_conv1d = _depthwise_conv(key_dim, self.kernel_size)
        self.forget_gate = ForgetGate(config)
        self.b_proj = ColumnLinear(config, hidden, self.num_heads)
        self.g_a_proj = ColumnLinear(config, hidden, self.head_dim)
        self.g_b_proj = ColumnLinear(config, self.head_dim, key_dim)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=config.params_dtype)
        self.o_proj = RowLinear(config, key_dim, hidden)
        self.sequence = SequenceParallel.of(pg_collection)  # None without sequence parallelism

    def _short_conv(
        self, weight: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU over time; x [b, s, C], weight [C, 1, kernel] -> [b, s, C] in x's dtype
        (computed in the weight's dtype, fp32). `positions` [s] (packed documents: each token's position in its
        document): the window restarts at each document, a tap reaching j tokens back counting only where
        position >= j (tensor code, the same for any packing)."""
        s = x.shape[1]
        if positions is None:
            y = F.conv1d(
                x.transpose(1, 2).to(weight.dtype),
                weight,
                padding=self.kernel_size - 1,
                groups=x.shape[-1],
            )
            return F.silu(y[..., :s]).to(x.dtype).transpose(1, 2)
        y = DocumentShortConv.apply(x.to(weight.dtype), weight[:, 0], positions)
        return F.silu(y).to(x.dtype)

    # packed documents: this module restarts its conv window and recurrent state at each boundary itself (fla's
    # varlen kernel, or tensor code over each token's document), instead of running once per document; it reads
    # only the documents' tensors, so a compiled layer calls it inside its graph (transformer_layer.py)
    accepts_documents = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        documents: Documents | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, D], attention_mask [b, s] bool (True = real token), documents: packed documents
        of a batch-1 row (layers/documents.py) -> ([s, b, D], None).

        Under sequence parallelism (parallel/sequence.py) s is this rank's S/N tokens and `documents` are the whole
        row's: the projections and gates run on the local tokens, one all-to-all per tensor hands every rank all S
        tokens of H/N heads for the short conv (its channels of the conv weights) and the delta rule, and one
        all-to-all brings the output back to the local tokens before the gated norm."""
        x = hidden_states.transpose(0, 1)  # [b, s, D]
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)  # padding contributes nothing to the state
        b, s, _ = x.shape
        heads = (b, s, self.num_heads, self.head_dim)
        sp = self.sequence
        if sp is None:
            to_heads, channels = (lambda t: t), slice(None)
        else:
            to_heads = sp.seq_to_heads
            width = self.num_heads // sp.size * self.head_dim
            channels = slice(sp.rank * width, (sp.rank + 1) * width)

        def conv(module: nn.Conv1d, y: torch.Tensor) -> torch.Tensor:
            """[b, S, h, d] -> the same, convolved per channel (per document)."""
            positions = None if documents is None else documents.positions
            return self._short_conv(module.weight[channels], y.flatten(-2), positions).view_as(y)

        q = conv(self.q_conv1d, to_heads(self.q_proj(x).reshape(heads)))  # [b, S, H/N, dk]
        k = conv(self.k_conv1d, to_heads(self.k_proj(x).reshape(heads)))
        v = conv(self.v_conv1d, to_heads(self.v_proj(x).reshape(heads)))
        g = to_heads(self.forget_gate(x))  # [b, S, H/N, dk] fp32
        beta = to_heads(torch.sigmoid(self.b_proj(x))[..., None])[..., 0]  # [b, S, H/N]

        core = kda_attention(q, k, v, g, beta, backend=self.kda_impl, documents=documents)  # [b, S, H/N, dv]
        if sp is not None:
            core = sp.heads_to_seq(core)  # [b, s, H, dv]
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(heads)
        out = self.o_proj(self.o_norm(core, gate).reshape(b, s, -1))
        return out.transpose(0, 1), None


class DocumentShortConv(torch.autograd.Function):
    """The causal depthwise conv of packed documents, before its SiLU: x [b, s, C], weight [C, kernel],
    positions [s] (each token's position in its document) -> y [b, s, C], with
    y[t] = sum_j weight[:, last - j] * x[t - j] over the taps j < kernel with positions[t] >= j (the window restarts
    at each document). Tensor code, the same for any packing, so a compiled layer traces it whole.

    It has its own backward, shaped as conv1d's: one gradient the size of x, each tap's part added into it. Autograd
    of the tap loop built one gradient of the padded input per tap: its step peaked at 9x x's size, this one's at
    4x, conv1d's at 3x (tests/layers/test_kda_ops.py); a packed medium-width KDA layer's step peaked 12 MiB above the
    whole row's (1066 vs 1054 MiB), and now peaks as the whole row's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, positions)
        last = weight.shape[-1] - 1
        # weight[:, last] multiplies the token itself, weight[:, last - j] the token j back: x[:, :-j] for the
        # outputs y[:, j:] (none when s <= j), except the outputs whose document began less than j tokens back
        y = x * weight[:, last]
        for j in range(1, last + 1):
            skips = (positions[j:] < j)[None, :, None]
            y[:, j:] += (x[:, :-j] * weight[:, last - j]).masked_fill_(skips, 0.0)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, positions = ctx.saved_tensors
        last = weight.shape[-1] - 1
        grad_x = grad * weight[:, last]
        grad_weight = torch.zeros_like(weight)
        grad_weight[:, last] = (grad * x).sum((0, 1))
        for j in range(1, last + 1):
            skips = (positions[j:] < j)[None, :, None]  # the outputs tap j did not reach
            # one [b, s - j, C] product at a time, masked in place
            grad_x[:, :-j] += (grad[:, j:] * weight[:, last - j]).masked_fill_(skips, 0.0)
            grad_weight[:, last - j] = (grad[:, j:] * x[:, :-j]).masked_fill_(skips, 0.0).sum((0, 1))
        return grad_x, grad_weight, None


def _depthwise_conv(channels: int, kernel_size: int) -> nn.Conv1d:
    conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False, dtype=torch.float32)
    return conv
