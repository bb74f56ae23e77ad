"""Routed experts stored as grouped tensors, computed as grouped GEMMs over tokens sorted by expert (dropless).

`gate_up_proj [E_local, 2 * I_local, D]` (rows: gate, then up) and `down_proj [E_local, D, I_local]` hold this
rank's `ExpertShard` (`parallel/expert_shard.py`): its experts and, under expert tensor parallelism, its slice of
each expert's intermediate dimension. The parameters carry `allreduce = False` (megatron's convention for
expert-parallel parameters): their replicas are the ranks holding the same shard, not the world. Clamped SwiGLU as
HF: gate clamped above at `swiglu_limit`, up clamped to [-limit, limit].

Backends (`moe_impl`, glm53_ds/backends.py):
  - `grouped`: rows sorted by expert, `gate_up` and `down` each one `torch._grouped_mm` over all local experts with
    device offsets (no Python loop over experts, no host sync on CUDA sm90+ in bf16), the clamped SwiGLU between
    them fused into the same autograd node (`_GroupedSwiGLU`: it keeps only the rows and the gate/up output for
    backward and writes out the backward by hand). An expert with no rows gets a zero gradient, so every rank's
    expert gradients exist and ZeRO never waits on a missing one. On CUDA in fp32 / fp16, or below sm90, torch's
    grouped GEMM falls back to a loop that copies the offsets to the host (one sync per grouped GEMM). The GEMMs
    need 16-byte aligned rows: hidden size and I_local multiples of 16 / element size (8 in bf16).
  - `loop`: the reference: one GEMM pair per expert over its rows (`torch.split` by host counts: one sync), the
    weights indexed per expert. Kept for parity and for the benchmark; its backward zero-fills a full-size
    gradient per expert (`SelectBackward`), O(E² I D) memory traffic.
  - `auto`: grouped when the sizes are aligned for the dtype, else loop.
With LoRA adapters (`self.lora`, `layers/lora.py`) the grouped path runs each projection as its own grouped GEMM
(`_GroupedLinear`) plus the adapter's two (its rank a multiple of the alignment step too), and the loop path adds
each expert's adapter output; without them nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import backends, host_reads
from ...parallel.expert_shard import ExpertShard, balanced_split
from ...transformer_config import Glm53TransformerConfig
from ..block_fp8 import (
    ROUTED,
    BlockFp8Weight,
    BlockLayout,
    Piece,
    block_fp8_linear,
    block_fp8_weight,
    register_block_fp8,
)
from ..lora import GroupedLora
from .grouped_mm import grouped_mm
from .token_permutation import RoutedTokens


def _clamped_swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """h [N, 2I] (gate, up) -> silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _clamped_swiglu_backward(h: torch.Tensor, grad: torch.Tensor, limit: float | None) -> torch.Tensor:
    """d/dh of `_clamped_swiglu` for an output gradient grad [N, I] -> [N, 2I] (clamp passes the gradient where
    the input lies inside the bounds, bounds included, as torch's clamp)."""
    gate, up = h.chunk(2, dim=-1)
    gate_c, up_c = gate, up
    if limit is not None:
        gate_c, up_c = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if torch.compiler.is_compiling():
        # Dynamo refuses `out=` into the halves' (strided) views; inductor fuses this into one kernel that writes
        # d_h, so the compiled graph holds no more than eager's `out=` path below.
        d_gate = torch.ops.aten.silu_backward(grad * up_c, gate_c)
        d_up = grad * F.silu(gate_c)
        if limit is not None:
            d_gate = d_gate.masked_fill(gate > limit, 0.0)
            d_up = d_up.masked_fill((up < -limit) | (up > limit), 0.0)
        return torch.cat([d_gate, d_up], dim=-1)
    d_h = torch.empty_like(h)
    d_gate, d_up = d_h.chunk(2, dim=-1)
    torch.ops.aten.silu_backward(grad * up_c, gate_c, grad_input=d_gate)  # grad·up·silu'(gate), one pass
    torch.mul(grad, F.silu(gate_c), out=d_up)
    if limit is not None:
        d_gate.masked_fill_(gate > limit, 0.0)
        d_up.masked_fill_((up < -limit) | (up > limit), 0.0)
    return d_h


class _GroupedSwiGLU(torch.autograd.Function):
    """rows [N, D] sorted by expert, offs int32 [E] (end of each expert's rows), gate_up [E, 2I, D],
    down [E, D, I] -> down_e(swiglu(gate_up_e x)) per row [N, D]."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        offs: torch.Tensor,
        limit: float | None,
    ) -> torch.Tensor:
        h = grouped_mm(rows, gate_up.transpose(-2, -1), offs)  # [N, 2I]
        act = _clamped_swiglu(h, limit)  # [N, I]
        ctx.save_for_backward(rows, gate_up, down, offs, h)
        ctx.limit = limit
        return grouped_mm(act.contiguous(), down.transpose(-2, -1), offs)  # [N, D]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, gate_up, down, offs, h = ctx.saved_tensors
        grad = grad.contiguous()
        act = _clamped_swiglu(h, ctx.limit).contiguous()  # recomputed: cheaper than keeping it
        d_act = grouped_mm(grad, down, offs)  # [N, D] x [E, D, I] -> [N, I]
        d_down = grouped_mm(grad.t(), act, offs)  # [D, N] x [N, I] per expert -> [E, D, I]
        d_h = _clamped_swiglu_backward(h, d_act, ctx.limit).contiguous()  # [N, 2I]
        d_rows = grouped_mm(d_h, gate_up, offs)  # [N, 2I] x [E, 2I, D] -> [N, D]
        d_gate_up = grouped_mm(d_h.t(), rows, offs)  # [E, 2I, D]
        return d_rows, d_gate_up, d_down, None, None


class _BlockFp8SwiGLU(torch.autograd.Function):
    """`_GroupedSwiGLU` over frozen block-FP8 weights (layers/block_fp8.py): the same products in the same order
    (so the same values as the dequantised model's), no weight gradients; keeps only h [N, 2I] (and offs)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, offs: torch.Tensor, gate_up: BlockFp8Weight, down: BlockFp8Weight,
                limit: float | None) -> torch.Tensor:  # fmt: skip
        h = gate_up.grouped_mm(rows, offs, transpose=True)  # [N, 2I]
        ctx.save_for_backward(offs, h)
        ctx.weights, ctx.limit = (gate_up, down), limit  # module buffers, alive anyway
        return down.grouped_mm(_clamped_swiglu(h, limit).contiguous(), offs, transpose=True)  # [N, D]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offs, h = ctx.saved_tensors
        gate_up, down = ctx.weights
        d_act = down.grouped_mm(grad.contiguous(), offs, transpose=False)  # [N, I]
        d_h = _clamped_swiglu_backward(h, d_act, ctx.limit).contiguous()  # [N, 2I]
        return gate_up.grouped_mm(d_h, offs, transpose=False), None, None, None, None


class _GroupedLinear(torch.autograd.Function):
    """rows [N, in] sorted by expert, weight [E, out, in], offs int32 [E] -> rows through their expert's weight
    [N, out]; the weight's gradient only when it needs one (a frozen base weight has none)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight, offs)
        return grouped_mm(rows, weight.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        d_rows = grouped_mm(grad, weight, offs) if ctx.needs_input_grad[0] else None  # [N, in]
        d_weight = grouped_mm(grad.t(), rows, offs) if ctx.needs_input_grad[1] else None  # [E, out, in]
        return d_rows, d_weight, None


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _GroupedLinear.apply(rows.contiguous(), weight, offs)


def grouped_mm_step(dtype: torch.dtype) -> int:
    """The grouped GEMM's 16-byte stride rule in elements of `dtype`: row sizes must be multiples of it."""
    return 16 // dtype.itemsize


class GroupedExperts(nn.Module):
    def __init__(self, config: Glm53TransformerConfig, shard: ExpertShard | None = None) -> None:
        super().__init__()
        cfg = config.glm
        self.shard = shard or ExpertShard.for_config(cfg)
        self.num_local_experts = self.shard.num_local
        self.first_expert = self.shard.first_expert
        self.intermediate = self.shard.local_intermediate
        self.swiglu_limit = cfg.swiglu_limit
        self.moe_impl = config.moe_impl
        dtype = config.params_dtype
        self.block_fp8 = ROUTED in config.block_fp8_modules
        if self.block_fp8:  # the frozen base kept as stored (layers/block_fp8.py); loaded, never initialised
            self._register_block_fp8(config, cfg.hidden_size)
        else:
            self.gate_up_proj = nn.Parameter(
                torch.empty(self.num_local_experts, 2 * self.intermediate, cfg.hidden_size, dtype=dtype)
            )
            self.down_proj = nn.Parameter(
                torch.empty(self.num_local_experts, cfg.hidden_size, self.intermediate, dtype=dtype)
            )
            nn.init.normal_(self.gate_up_proj, mean=0.0, std=cfg.initializer_range)
            nn.init.normal_(self.down_proj, mean=0.0, std=cfg.initializer_range)
            self.gate_up_proj.allreduce = False  # type: ignore[attr-defined]
            self.down_proj.allreduce = False  # type: ignore[attr-defined]
        self.compute_dtype = dtype
        self.lora: GroupedLora | None = None  # LoRA adapters (`layers/lora_targets.py`)

    def _register_block_fp8(self, config: Glm53TransformerConfig, hidden: int) -> None:
        """gate_up [E_l, 2I_l, D]: this ETP rank's rows of the stored gate then up [I, D] tensors; down [E_l, D,
        I_l]: its columns of the stored down [D, I]."""
        block, mine = config.block_fp8_block, Piece(self.shard.rows.start, self.intermediate)
        whole = Piece(0, hidden)
        register_block_fp8(
            self, "gate_up_proj", self.num_local_experts, BlockLayout((mine, mine), (whole,), block)
        )
        register_block_fp8(self, "down_proj", self.num_local_experts, BlockLayout((whole,), (mine,), block))

    def impl(self, dtype: torch.dtype) -> str:
        """The backend `moe_impl` means for activations of `dtype`."""
        step = grouped_mm_step(dtype)
        sizes = [self.gate_up_proj.shape[-1], self.intermediate] + (
            [self.lora.gate_up_A.shape[1]] if self.lora else []
        )
        aligned = all(n % step == 0 for n in sizes)
        impl = backends.check(backends.MOE, self.moe_impl)
        if impl == "auto":
            return "grouped" if aligned else "loop"
        if impl == "grouped" and not aligned:
            raise ValueError(
                f"moe_impl='grouped': the grouped GEMM needs hidden_size ({self.gate_up_proj.shape[-1]}), the "
                f"local moe_intermediate_size ({self.intermediate}) and a LoRA rank to be multiples of {step} in "
                f"{dtype}; use moe_impl='loop' or 'auto'"
            )
        return impl

    def ffn(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, D] sorted by local expert, counts [E_local] int (rows per local expert, on the device) ->
        each row through its expert's FFN (slice) [N, D]."""
        if self.impl(rows.dtype) == "loop":
            return self._loop(rows, counts)
        offs = counts.cumsum(0).to(torch.int32)
        if self.lora is not None:
            return self._grouped_with_lora(rows, offs, self.lora)
        if self.block_fp8:
            gate_up, down = block_fp8_weight(self, "gate_up_proj"), block_fp8_weight(self, "down_proj")
            return _BlockFp8SwiGLU.apply(rows.contiguous(), offs, gate_up, down, self.swiglu_limit)
        return _GroupedSwiGLU.apply(
            rows.contiguous(), self.gate_up_proj, self.down_proj, offs, self.swiglu_limit
        )

    def _grouped_with_lora(self, rows: torch.Tensor, offs: torch.Tensor, lora: GroupedLora) -> torch.Tensor:
        """`ffn` with adapters: W x + s B A x for gate_up and for down, each a grouped GEMM."""
        s = lora.scale
        gate_up_a, down_b = lora.replicated(lora.gate_up_A), lora.replicated(lora.down_B)
        h = self._base(rows, "gate_up_proj", offs)  # [N, 2I_l]
        h = h + s * _grouped_linear(_grouped_linear(lora.drop(rows), gate_up_a, offs), lora.gate_up_B, offs)
        act = _clamped_swiglu(h, self.swiglu_limit)  # [N, I_l]
        out = self._base(act, "down_proj", offs)  # [N, D]
        return out + s * _grouped_linear(_grouped_linear(lora.drop(act), lora.down_A, offs), down_b, offs)

    def _base(self, rows: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        if self.block_fp8:
            return block_fp8_linear(rows, offs, block_fp8_weight(self, name))
        return _grouped_linear(rows, getattr(self, name), offs)

    def expert_ffn(self, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """The reference: one expert's (slice of its) FFN on its tokens x [n, D] -> [n, D]."""
        h = self._expert_linear(x, "gate_up_proj", local_expert)
        if self.lora is not None:
            h = h + self.lora.expert_delta("gate_up", local_expert, x)
        gate, up = h.chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        act = F.silu(gate) * up
        out = self._expert_linear(act, "down_proj", local_expert)
        return out if self.lora is None else out + self.lora.expert_delta("down", local_expert, act)

    def _expert_linear(self, x: torch.Tensor, name: str, local_expert: int) -> torch.Tensor:
        if not self.block_fp8:
            return F.linear(x, getattr(self, name)[local_expert])
        w = block_fp8_weight(self, name)
        one = BlockFp8Weight(w.data[local_expert : local_expert + 1], w.scale[local_expert : local_expert + 1],
                             w.row_block, w.col_block)  # fmt: skip
        return block_fp8_linear(x, torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device), one)

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # shape-only (plan/): the load the router's bias steers towards
        sizes = host_reads.to_list(counts, shape_only=lambda: balanced_split(rows.shape[0], counts.numel()))
        chunks = torch.split(rows, sizes)
        outputs = [self.expert_ffn(e, chunk) for e, chunk in enumerate(chunks) if chunk.shape[0] > 0]
        return torch.cat(outputs) if outputs else rows.new_zeros(rows.shape)

    def forward(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        routed: RoutedTokens | None = None,
    ) -> torch.Tensor:
        """x [T, D], expert_ids / weights [T, k] (global expert ids), `routed` the same pairs sorted by expert
        (sorted here when not given) -> weighted sum of the experts [T, D]. Every expert is local here (EP = 1;
        under EP the dispatcher calls `ffn`)."""
        if self.shard.ep != 1:
            raise ValueError(
                f"GroupedExperts.forward computes all experts on one rank; this shard is EP rank "
                f"{self.shard.ep_rank} of {self.shard.ep} (use ExpertParallelDispatch)"
            )
        if self.impl(x.dtype) == "loop":
            return self._forward_loop(x, expert_ids, weights)
        if routed is None:
            routed = RoutedTokens.sort(expert_ids, self.num_local_experts)
        return routed.combine(self.ffn(routed.gather(x), routed.counts), weights, x.dtype)

    def _forward_loop(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference loop: a nonzero per expert, a GEMM pair per expert, an index_add."""
        out = torch.zeros_like(x)
        local_ids = expert_ids - self.first_expert
        for e in range(self.num_local_experts):
            token_idx, slot = torch.where(local_ids == e)
            if token_idx.numel() == 0:
                continue
            y = self.expert_ffn(e, x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
