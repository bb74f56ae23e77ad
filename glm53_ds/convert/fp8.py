"""The released block-FP8 format (DeepSeek-V3 / GLM FP8 release convention): reading it, checking it, making it.

A weight `W [out, in]` stored as `torch.float8_e4m3fn` (or e5m2) comes with `<name minus .weight>.weight_scale_inv`,
fp32 of shape `[ceil(out / br), ceil(in / bc)]`, `(br, bc)` the config's `quantization_config.weight_block_size`:
the value of a block is `fp8 * scale_inv[block]` (the stored scale is the inverse of the quantisation scale, so
dequantisation multiplies). Edge blocks are partial. Refused, naming the tensor or key: any other scale shape, a
scale spelled `.weight_scale` (some quantisers store the quantisation scale under it, others its inverse: which one
cannot be told from the file), a `quantization_config` that is not block FP8, and FP8 tensors without one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
AMBIGUOUS_SCALE_SUFFIX = ".weight_scale"


class Fp8FormatError(ValueError):
    pass


def is_fp8_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_name(name: str) -> str:
    """The scale tensor's name of a stored FP8 weight."""
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + SCALE_SUFFIX


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's block-FP8 format: (rows, columns) per scale block."""

    block: tuple[int, int]

    @classmethod
    def of_config(cls, raw: Mapping[str, Any], source: str) -> Fp8Format | None:
        """From a config.json's `quantization_config` (top level, or the text config's); None when it has none."""
        text = raw.get("text_config")
        quant = raw.get("quantization_config") or (
            text.get("quantization_config") if isinstance(text, Mapping) else None
        )
        if not quant:
            return None
        if not isinstance(quant, Mapping):
            raise Fp8FormatError(
                f"{source}: quantization_config must be an object, got {type(quant).__name__}"
            )
        method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
        if method != "fp8" or fmt not in ("e4m3", "e5m2"):
            raise Fp8FormatError(f"{source}: quantization_config quant_method={method!r} fmt={fmt!r}: only block "
                                 "FP8 (quant_method 'fp8', fmt e4m3 or e5m2) is read")  # fmt: skip
        block = quant.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):  # fmt: skip
            raise Fp8FormatError(f"{source}: quantization_config.weight_block_size={block!r}: expected two positive "
                                 "integers [rows, columns] (per-tensor or per-channel FP8 is not read)")  # fmt: skip
        return cls((block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
        out_f, in_f = shape
        return math.ceil(out_f / self.block[0]), math.ceil(in_f / self.block[1])

    def check_scale(self, name: str, weight_shape: tuple[int, ...] | list[int],
                    scale_shape: tuple[int, ...] | list[int]) -> None:  # fmt: skip
        if len(weight_shape) != 2:
            raise Fp8FormatError(
                f"{name}: FP8 weights must be 2-D [out, in], got shape {tuple(weight_shape)}"
            )
        expected = self.scale_shape(weight_shape)
        if tuple(scale_shape) != expected:
            raise Fp8FormatError(
                f"{name}: unknown FP8 scale layout: weight_scale_inv has shape {tuple(scale_shape)}, expected "
                f"{expected} ({self.block[0]}x{self.block[1]} blocks of a {weight_shape[0]}x{weight_shape[1]} weight)"
            )

    def dequantize(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """fp32 values of a stored weight (each element times its block's scale)."""
        self.check_scale(name, tuple(weight.shape), tuple(scale_inv.shape))
        out_f, in_f = weight.shape
        br, bc = self.block
        scale = scale_inv.float().repeat_interleave(br, 0)[:out_f].repeat_interleave(bc, 1)[:, :in_f]
        return weight.float() * scale


def check_scale_spellings(names: list[str], source: str) -> None:
    """Refuse `.weight_scale` companions: the quantisation scale or its inverse, the file cannot say which."""
    ambiguous = [n for n in names if n.endswith(AMBIGUOUS_SCALE_SUFFIX)]
    if ambiguous:
        raise Fp8FormatError(
            f"{source}: {len(ambiguous)} scale tensor(s) spelled '.weight_scale' (e.g. {ambiguous[0]}): whether they "
            "hold the quantisation scale or its inverse cannot be proved from the checkpoint; glm53_ds reads the "
            "released convention '.weight_scale_inv' (dequantise = fp8 x scale_inv). Rename them if they are inverses"
        )


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (tests, `--export-format fp8`): (fp8 e4m3 weight, fp32 scale_inv) with the released rounding:
    each block's largest magnitude maps to the format's largest value (partial edge blocks: their own largest)."""
    out_f, in_f = weight.shape
    br, bc = block
    rows, cols = math.ceil(out_f / br), math.ceil(in_f / bc)
    padded = torch.zeros(rows * br, cols * bc, dtype=torch.float32, device=weight.device)
    padded[:out_f, :in_f] = weight.float()
    blocks = padded.view(rows, br, cols, bc)  # [R, br, C, bc]
    scale_inv = (
        blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    )  # [R, C]
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * br, cols * bc)
    return q[:out_f, :in_f].contiguous(), scale_inv
