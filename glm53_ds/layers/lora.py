"""LoRA adapters: W x + (alpha / r) B A dropout(x), on a projection or on the routed experts' grouped tensors.

A projection's adapter is a child module named `lora` of the projection itself, so the base parameter keeps its
name (`...q_b_proj.weight`) and the adapter's names follow it (`...q_b_proj.lora.A` [r, in], `...lora.B`
[out, r]); the projection adds the adapter's output in a forward hook (megatron's and glm53_ds's linears return the
tensor or `(tensor, bias)`). The routed experts' adapters are `GroupedLora` (`experts.lora.gate_up_A
[E_local, r, D]`, `gate_up_B [E_local, 2I_local, r]`, `down_A [E_local, r, I_local]`, `down_B [E_local, D, r]`),
which `GroupedExperts` computes with its own GEMMs. Which projections get one: `lora_targets.py`.

Expert adapters follow `ExpertShard` like the expert weights: `gate_up_B` holds this ETP rank's gate rows then up
rows, `down_A` its columns; `gate_up_A` and `down_B` are whole on every ETP rank of a shard (every slice of an
expert needs all of `A x`, and the down output is summed over ETP anyway). Their gradient on one ETP rank is only
its slice's share, so the forward passes them through `sum_grad_over(etp_group)` (identity forward, sum over
ETP in backward): every ETP rank then holds the shard's gradient in the scale `moe_dispatch` gives expert
gradients. Every adapter starts from the same values at any layout: A from a generator seeded by the adapter's
name (the global tensor drawn, this shard's part kept: Kaiming-uniform, bound 1/sqrt(fan_in), as PEFT), B zero,
so a fresh adapter changes nothing (bitwise: the hook adds an exact zero).

`merged_weight` gives W + (alpha / r) B A in fp32, rounded once to W's dtype (per shard, for experts: the export).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.comm import sum_grad_over
from ..parallel.expert_shard import ExpertShard
from .block_fp8 import compute_like, dense_weight, is_block_fp8

LORA_TARGETS = ("mla", "kda", "mlp", "shared_expert", "experts")  # what lora_targets.py can adapt


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0  # the adapters' initial values (with each adapter's name)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: expected some of {', '.join(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def record(self) -> dict[str, Any]:
        """What checkpoints record of the adapters (their initial seed aside)."""
        return dict(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=list(self.targets))


def _kaiming_a(name: str, shape: Sequence[int], fan_in: int, seed: int) -> torch.Tensor:
    """The initial A of adapter `name` (global `shape`), the same on every rank and at every layout."""
    generator = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(tuple(shape)).uniform_(-bound, bound, generator=generator)


class LoraAdapter(nn.Module):
    """(alpha / r) B A dropout(x) for one projection of `in_features` -> `out_features`."""

    def __init__(
        self, name: str, in_features: int, out_features: int, spec: LoraSpec, like: torch.Tensor
    ) -> None:
        super().__init__()
        self.scale, self.dropout = spec.scale, spec.dropout
        a = _kaiming_a(name, (spec.rank, in_features), in_features, spec.seed)
        self.A = nn.Parameter(a.to(like.device, like.dtype))  # [r, in]
        self.B = nn.Parameter(
            torch.zeros(out_features, spec.rank, device=like.device, dtype=like.dtype)
        )  # [out, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return F.linear(F.linear(x, self.A), self.B) * self.scale


def add_adapter(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
    """Forward hook of a projection with an adapter: its output (or the output of a `(tensor, bias)` pair) plus
    the adapter's."""
    adapter = module.lora
    assert isinstance(adapter, LoraAdapter)
    delta = adapter(inputs[0])
    if isinstance(output, tuple):
        return (output[0] + delta.to(output[0].dtype), *output[1:])
    return output + delta.to(output.dtype)


class GroupedLora(nn.Module):
    """The routed experts' adapters of one MoE layer, grouped as the expert weights and sharded as they are."""

    def __init__(
        self, name: str, shard: ExpertShard, hidden: int, spec: LoraSpec, like: torch.Tensor
    ) -> None:
        super().__init__()
        self.scale, self.dropout, self.shard = spec.scale, spec.dropout, shard
        r, local = spec.rank, slice(shard.first_expert, shard.first_expert + shard.num_local)
        inner, rows = shard.local_intermediate, shard.rows

        def param(t: torch.Tensor) -> nn.Parameter:
            p = nn.Parameter(t.to(like.device, like.dtype).contiguous())
            p.allreduce = False  # type: ignore[attr-defined]  # replicas: the expert-data-parallel group
            return p

        gate_up_a = _kaiming_a(f"{name}.gate_up_A", (shard.n_experts, r, hidden), hidden, spec.seed)
        down_a = _kaiming_a(
            f"{name}.down_A", (shard.n_experts, r, shard.intermediate), shard.intermediate, spec.seed
        )
        self.gate_up_A = param(gate_up_a[local])  # [E_l, r, D], whole on every ETP rank
        self.gate_up_B = param(
            torch.zeros(shard.num_local, 2 * inner, r)
        )  # [E_l, 2I_l, r]: gate rows, up rows
        self.down_A = param(down_a[local][:, :, rows])  # [E_l, r, I_l]: this ETP rank's columns
        self.down_B = param(torch.zeros(shard.num_local, hidden, r))  # [E_l, D, r], whole on every ETP rank
        self.gate_up_A.etp_replicated = True  # type: ignore[attr-defined]
        self.down_B.etp_replicated = True  # type: ignore[attr-defined]
        self.etp_group: dist.ProcessGroup | None = None  # set by apply_lora when ETP > 1

    def replicated(self, t: torch.Tensor) -> torch.Tensor:
        """An ETP-replicated adapter as the forward uses it: its gradient summed over the ETP group."""
        return t if self.etp_group is None else sum_grad_over(t, self.etp_group)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def expert_delta(self, kind: str, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's adapter output for `kind` "gate_up" (x [n, D] -> [n, 2I_l]) or "down" ([n, I_l] -> [n, D])."""
        a: torch.Tensor
        b: torch.Tensor
        if kind == "gate_up":
            a, b = self.replicated(self.gate_up_A), self.gate_up_B
        else:
            a, b = self.down_A, self.replicated(self.down_B)
        return F.linear(F.linear(self.drop(x), a[local_expert]), b[local_expert]) * self.scale


def is_lora_param(name: str) -> bool:
    return ".lora." in name


def merged_weight(module: nn.Module, kind: str = "weight") -> torch.Tensor:
    """A projection's W + (alpha / r) B A (or a grouped expert tensor's, `kind` "gate_up_proj" / "down_proj"),
    computed in fp32 and rounded once to W's dtype; W itself when the module has no adapter. Differentiable: the
    export merges with it, and MLA's absorbed attention, which reads `kv_b_proj` as a weight, computes with it
    (there an adapter's dropout does not apply)."""
    lora = getattr(module, "lora", None)
    w = getattr(module, kind)
    assert isinstance(w, torch.Tensor)
    if is_block_fp8(w):  # a frozen base kept in block-FP8: its dense value, in the model's dtype
        w = dense_weight(module, kind, compute_like(module, w).dtype)
    if isinstance(lora, LoraAdapter):
        return (w.float() + lora.scale * (lora.B.float() @ lora.A.float())).to(w.dtype)
    if isinstance(lora, GroupedLora):
        a, b = (lora.gate_up_A, lora.gate_up_B) if kind == "gate_up_proj" else (lora.down_A, lora.down_B)
        return (w.float() + lora.scale * torch.bmm(b.float(), a.float())).to(w.dtype)
    return w


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter merged into its weight (`merged_weight`) and no adapter tensors:
    the model a LoRA run exports (fp32-kept and other unadapted tensors as they are; a block-FP8 base dequantised
    to the model's dtype, without its scales)."""
    state = {k: v for k, v in model.state_dict().items() if not is_lora_param(k)}
    with torch.no_grad():
        for name, module in model.named_modules():
            lora = getattr(module, "lora", None)
            for kind in getattr(module, "block_fp8_layouts", {}):
                state[f"{name}.{kind}"] = merged_weight(module, kind)
                del state[f"{name}.{kind}_scale_inv"]
            if isinstance(lora, LoraAdapter):
                state[f"{name}.weight"] = merged_weight(module)
            elif isinstance(lora, GroupedLora):
                for kind in ("gate_up_proj", "down_proj"):
                    state[f"{name}.{kind}"] = merged_weight(module, kind)
    return state
