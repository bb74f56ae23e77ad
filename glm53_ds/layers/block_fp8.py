"""Frozen weights kept resident in block-FP8 (the released checkpoint's own storage), dequantised tile by tile.

The release stores a weight `W [out, in]` as `float8_e4m3fn` plus fp32 `weight_scale_inv [ceil(out / br),
ceil(in / bc)]`, one per `br x bc` block (`quantization_config.weight_block_size`): `W[r, c] = fp8[r, c] *
scale_inv[r // br, c // bc]`. A module here holds a weight that way (`data`, `scale`) and never as a whole in
bf16: only the tile a GEMM is about to use is dequantised, and what autograd keeps for the backward is the FP8
weight and its scales (module buffers: nothing per step), never a dequantised copy; the weight gets no gradient.

A module's tensor may stack slices of several stored tensors (an expert's gate rows then its up rows, or this ETP
rank's slice of them), so the block of an element is read through two index tables, not by division:
`W[r, c] = data[r, c] * scale[row_block[r], col_block[c]]` (`BlockLayout` builds them from the pieces' positions in
the stored tensors; a piece that starts inside a block, or ends in a partial edge block, keeps that block's scale).

The value is the dequantised model's, bit for bit: every tile is dequantised as the loader of `--base-quant none`
does (`fp8.float() * scale`, then rounded once to the activation dtype), and multiplied by the same GEMM.
Implementations: the torch reference (any device; an expert's weight is its tile) and, on CUDA, the Triton kernel
(`block_fp8_triton.py`: the dequantisation inside the GEMM's K loop).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..parallel.params import EXPERT_BUFFERS
from .fused_kernels import FusedKernel, register

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The module kinds that can hold their frozen weights in block-FP8 (the kinds the release stores that way).
ROUTED, SHARED, DENSE = "routed_experts", "shared_experts", "dense_mlp"
KINDS = (ROUTED, SHARED, DENSE)
RELEASED_BLOCK = (128, 128)  # GLM-5.3-Flash's FP8 release (quantization_config.weight_block_size)


@dataclass(frozen=True)
class Piece:
    """`length` consecutive rows (or columns) of a stored tensor, from `start`, placed next in the module's."""

    start: int
    length: int


def block_table(pieces: Sequence[Piece], block: int) -> tuple[torch.Tensor, list[slice]]:
    """(table int32 [sum of lengths]: each module row's row of the module's scale tensor, and for each piece the
    rows of the stored scale tensor it takes, in order: the module's scale rows are those spans stacked)."""
    table, spans, offset = [], [], 0
    for p in pieces:
        first, last = p.start // block, (p.start + p.length - 1) // block
        spans.append(slice(first, last + 1))
        table.append(offset + (torch.arange(p.length) + p.start % block) // block)
        offset += last - first + 1
    return torch.cat(table).to(torch.int32), spans


@dataclass(frozen=True)
class BlockLayout:
    """How a module's (per-expert) weight [rows, cols] maps onto the stored tensors' block scales."""

    rows: tuple[Piece, ...]
    cols: tuple[Piece, ...]
    block: tuple[int, int]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return block_table(self.rows, self.block[0])[0], block_table(self.cols, self.block[1])[0]

    def scale_shape(self) -> tuple[int, int]:
        r, c = block_table(self.rows, self.block[0])[1], block_table(self.cols, self.block[1])[1]
        return sum(s.stop - s.start for s in r), sum(s.stop - s.start for s in c)

    def scale_piece(self, row_piece: int) -> tuple[slice, slice, slice]:
        """For the stored tensor that fills row piece `row_piece` (and every column piece: a stored tensor spans
        the module's columns): (its rows of the stored scale, its columns of it, the module scale rows it fills)."""
        row_spans = block_table(self.rows, self.block[0])[1]
        (col_span,) = block_table(self.cols, self.block[1])[1]
        before = sum(s.stop - s.start for s in row_spans[:row_piece])
        span = row_spans[row_piece]
        return span, col_span, slice(before, before + span.stop - span.start)


def dequantize(data: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """data [rows, cols] FP8, scale [nR, nC] fp32 -> the weight [rows, cols] in `dtype` (as the loader rounds)."""
    factors = scale.float().index_select(0, row_block.long()).index_select(1, col_block.long())
    return (data.float() * factors).to(dtype)


# --------------------------------------------------------------------------- the GEMMs (reference)
def _grouped_reference(
    x: torch.Tensor, weight: BlockFp8Weight, counts: list[int], transpose: bool
) -> torch.Tensor:
    """x [N, k] in groups of `counts` rows -> each group times its expert's weight (W^T when `transpose`)."""
    outputs = []
    for e, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0] == 0:
            continue
        w = dequantize(weight.data[e], weight.scale[e], weight.row_block, weight.col_block, x.dtype)
        outputs.append(rows @ (w.t() if transpose else w))  # the tile lives for this product only
    out_features = weight.data.shape[1] if transpose else weight.data.shape[2]
    return torch.cat(outputs) if outputs else x.new_zeros(x.shape[0], out_features)


@dataclass
class BlockFp8Weight:
    """One module weight in block-FP8: data [E, rows, cols] FP8, scale [E, nR, nC] fp32, row_block [rows],
    col_block [cols] int32 (E = 1 for a plain linear). Views of the owning module's buffers."""

    data: torch.Tensor
    scale: torch.Tensor
    row_block: torch.Tensor
    col_block: torch.Tensor

    def grouped_mm(self, x: torch.Tensor, offs: torch.Tensor, transpose: bool) -> torch.Tensor:
        return _block_fp8_grouped_mm_op(
            x, self.data, self.scale, self.row_block, self.col_block, offs, transpose
        )


# --------------------------------------------------------------------------- the custom op
@torch.library.custom_op("glm53::block_fp8_grouped_mm", mutates_args=())
def _block_fp8_grouped_mm_op(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor,
                             col_block: torch.Tensor, offs: torch.Tensor, transpose: bool) -> torch.Tensor:  # fmt: skip
    """x [N, in] sorted by group, offs [E] (each group's end) -> x @ dequantised W_e^T ([N, rows]; `transpose`)
    or x @ W_e ([N, cols]): the Triton kernel on CUDA, the per-group reference elsewhere."""
    if x.is_cuda:
        from . import block_fp8_triton  # noqa: PLC0415  (Triton only where it runs)

        return block_fp8_triton.grouped_mm(x, data, scale, row_block, col_block, offs, transpose)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()  # host tensor: no sync
    return _grouped_reference(x, BlockFp8Weight(data, scale, row_block, col_block), counts, transpose)


@_block_fp8_grouped_mm_op.register_fake
def _(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor,
      offs: torch.Tensor, transpose: bool) -> torch.Tensor:  # fmt: skip
    return x.new_empty(x.shape[0], data.shape[1] if transpose else data.shape[2])


register(FusedKernel("block_fp8_grouped_mm", "glm53::block_fp8_grouped_mm"))


class _BlockFp8Linear(torch.autograd.Function):
    """rows [N, in] sorted by group, offs int32 [E] -> rows through their group's dequantised weight [N, out].
    Keeps nothing of the inputs (no weight gradient); the backward dequantises again."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, offs: torch.Tensor, weight: BlockFp8Weight) -> torch.Tensor:
        ctx.weight = weight  # module buffers, alive anyway
        ctx.save_for_backward(offs)
        return weight.grouped_mm(rows, offs, transpose=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (offs,) = ctx.saved_tensors
        return ctx.weight.grouped_mm(grad.contiguous(), offs, transpose=False), None, None


def block_fp8_linear(rows: torch.Tensor, offs: torch.Tensor, weight: BlockFp8Weight) -> torch.Tensor:
    return _BlockFp8Linear.apply(rows.contiguous(), offs, weight)


# --------------------------------------------------------------------------- modules' storage
def register_block_fp8(module: nn.Module, name: str, experts: int, layout: BlockLayout,
                       device: torch.device | str | None = None) -> None:  # fmt: skip
    """Give `module` the buffers of a block-FP8 weight `name`: `name` FP8 [experts, rows, cols] (a plain linear:
    [rows, cols]), `name_scale_inv` fp32, and its two (non-persistent) block tables. Buffers, not parameters:
    nothing trains them, DeepSpeed neither casts nor flattens them, and they keep their state-dict names."""
    row_block, col_block = layout.tables()
    rows, cols = row_block.numel(), col_block.numel()
    shape = (experts,) if experts else ()
    module.register_buffer(name, torch.zeros(*shape, rows, cols, dtype=torch.float8_e4m3fn, device=device))
    module.register_buffer(f"{name}_scale_inv", torch.zeros(*shape, *layout.scale_shape(), device=device))
    module.register_buffer(f"{name}_row_block", row_block.to(device), persistent=False)
    module.register_buffer(f"{name}_col_block", col_block.to(device), persistent=False)
    layouts = module.__dict__.setdefault("block_fp8_layouts", {})
    layouts[name] = layout
    if (
        experts
    ):  # routed experts: sharded over EP x ETP like expert parameters (parallel/params.expert_buffer_names)
        module.__dict__.setdefault(EXPERT_BUFFERS, set()).update((name, f"{name}_scale_inv"))


def block_fp8_layout(module: nn.Module, name: str) -> BlockLayout:
    """Which stored blocks the block-FP8 weight `name` of `module` holds (set by `register_block_fp8`)."""
    layout = module.__dict__["block_fp8_layouts"][name]
    assert isinstance(layout, BlockLayout)
    return layout


def block_fp8_weight(module: nn.Module, name: str) -> BlockFp8Weight:
    data, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
    if data.dim() == 2:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    return BlockFp8Weight(
        data, scale, getattr(module, f"{name}_row_block"), getattr(module, f"{name}_col_block")
    )


def _block_fp8_buffers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(module name, module, buffer name) of every block-FP8 weight of `model` and of its scales."""
    for prefix, module in model.named_modules():
        for name in module.__dict__.get("block_fp8_layouts", {}):
            for suffix in ("", "_scale_inv"):
                yield prefix, module, f"{name}{suffix}"


def block_fp8_state_names(model: nn.Module) -> set[str]:
    """The state-dict names of `model`'s block-FP8 weights and their scales (a frozen base: never checkpointed)."""
    return {f"{prefix}{'.' if prefix else ''}{name}" for prefix, _, name in _block_fp8_buffers(model)}


@contextmanager
def block_fp8_left_out(model: nn.Module) -> Iterator[None]:
    """`model.state_dict()` without its block-FP8 weights and scales while inside (a frozen base, reloaded from its
    source: a checkpoint's model files must not carry it, nor a copy another run could load as dense values)."""
    marked = [(module, name) for _, module, name in _block_fp8_buffers(model)]
    for module, name in marked:
        module._non_persistent_buffers_set.add(name)
    try:
        yield
    finally:
        for module, name in marked:
            module._non_persistent_buffers_set.discard(name)


def is_block_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def compute_like(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A tensor of the device and dtype that computes with `weight` (an adapter's): the model's dtype for a
    block-FP8 weight, else the weight itself."""
    if not is_block_fp8(weight):
        return weight
    dtype = module.compute_dtype
    assert isinstance(dtype, torch.dtype)
    return torch.empty(0, dtype=dtype, device=weight.device)


def dense_weight(module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight `name` as a dense tensor in `dtype` (the export, the merge, a reference): whole, so
    only for one module at a time."""
    w = block_fp8_weight(module, name)
    out = torch.stack([dequantize(w.data[e], w.scale[e], w.row_block, w.col_block, dtype)
                       for e in range(w.data.shape[0])])  # fmt: skip
    return out if getattr(module, name).dim() == 3 else out[0]


class BlockFp8Linear(nn.Module):
    """A frozen linear (no bias) whose weight stays in block-FP8: `weight` [out, in] FP8 and `weight_scale_inv`.
    Takes megatron's linear constructor (a drop-in for `ColumnParallelLinear` / `RowParallelLinear` in an `MLP`
    without tensor parallelism) and returns `(output, None)` as they do. `rows`: the stored tensors stacked in
    `weight` (a fused gate | up takes two of `out_features // 2`), for their block scales."""

    def __init__(
        self, input_size: int, output_size: int, *, config: Any, stacked: int = 1, **unused: Any
    ) -> None:
        super().__init__()
        block = tuple(config.block_fp8_block)
        part = output_size // stacked
        layout = BlockLayout(tuple(Piece(0, part) for _ in range(stacked)), (Piece(0, input_size),), block)
        register_block_fp8(self, "weight", 0, layout)
        self.compute_dtype = config.params_dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows = x.reshape(-1, x.shape[-1])
        offs = torch.full((1,), rows.shape[0], dtype=torch.int32, device=rows.device)
        out = block_fp8_linear(rows, offs, block_fp8_weight(self, "weight"))
        return out.reshape(*x.shape[:-1], out.shape[-1]), None


class StackedBlockFp8Linear(BlockFp8Linear):
    """megatron MLP's `linear_fc1`: gate rows then up rows, two stored tensors."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **unused: Any) -> None:
        super().__init__(input_size, output_size, config=config, stacked=2)


def mlp_linears(config: Any, kind: str) -> tuple[type[nn.Module], type[nn.Module]] | None:
    """(linear_fc1, linear_fc2) classes of a megatron MLP of `kind` whose weights stay in block-FP8, else None."""
    return (
        (StackedBlockFp8Linear, BlockFp8Linear) if kind in getattr(config, "block_fp8_modules", ()) else None
    )
