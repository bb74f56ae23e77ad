"""`--base-quant`: whether a run keeps the frozen weights its checkpoint stores in block-FP8 as stored
(layers/block_fp8.py) or dequantises them at load, decided before anything expensive.

- `fp8`: every module kind the checkpoint stores wholly in block-FP8 (routed experts, shared experts, dense MLPs;
  hf_loader.block_fp8_kinds) stays so; refused, in one line naming the option and the tensors, where the weights are
  not block-FP8 (a bf16 checkpoint is never quantised; a native checkpoint holds dense weights), or where they
  would train (full fine-tuning, or a `--trainable` that matches them).
- `none`: dequantised at load to the model's dtype (an FP8 download is read directly either way).
- `auto`: `fp8` for a LoRA run on an FP8 checkpoint whose FP8 weights stay frozen, else `none`.
The choice is said in one start-up line and recorded with the base (`kept`): a resume that keeps the base another
way is announced (the values are the same: the dequantised base's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Glm53Config
from ..convert.names import released_layout
from ..hf_loader import SafetensorsCheckpoint, block_fp8_kinds, tensor_kind
from .config import TrainConfig
from .errors import SetupError
from .trainable import trains

DENSE_KEPT, FP8_KEPT = "dense", "block_fp8"


@dataclass(frozen=True)
class BaseQuant:
    kinds: tuple[str, ...] = ()  # module kinds kept in block-FP8 (empty: all dense)
    block: tuple[int, int] = (128, 128)
    line: str | None = None  # the start-up line (None: nothing stored in FP8, nothing to say)

    @property
    def kept(self) -> str:
        return FP8_KEPT if self.kinds else DENSE_KEPT

    def transformer_fields(self) -> dict[str, Any]:
        return dict(block_fp8_modules=self.kinds, block_fp8_block=self.block) if self.kinds else {}


def resolve_base_quant(c: TrainConfig, cfg: Glm53Config, weights_dir: str | None, mtp: bool) -> BaseQuant:
    """The run's `BaseQuant` from --base-quant and the weights it starts from (`weights_dir`: released-layout)."""
    option = f"--base-quant {c.base_quant}"
    stored: tuple[str, ...] = ()
    block = (128, 128)
    if weights_dir:
        try:
            checkpoint = SafetensorsCheckpoint(weights_dir)
            stored = block_fp8_kinds(checkpoint, cfg)
            if stored:
                block = checkpoint.fp8_format("the checkpoint's FP8 weights").block
        except (OSError, ValueError) as e:
            raise SetupError(f"--hf-dir {weights_dir}: {e}") from e
    if not stored:
        if c.export_format == "fp8":
            raise SetupError(f"--export-format fp8: {f'--hf-dir {weights_dir}' if weights_dir else 'the run'} "
                             "stores no weights in block-FP8, so there is no FP8 layout to export to (use "
                             "--export-format dense)")  # fmt: skip
        if c.base_quant == "fp8":
            where = f"--hf-dir {weights_dir} stores no weights in block-FP8" if weights_dir else (
                "the run's weights are not a released FP8 checkpoint (--load: a native checkpoint holds dense "
                "weights; no weights: random ones)")  # fmt: skip
            raise SetupError(f"{option}: {where}; nothing is quantised here (use --base-quant none or auto)")
        return BaseQuant()
    names = _native_names(cfg, mtp, stored)
    lora = c.lora_rank > 0
    training = [n for n in names if trains(n, lora, c.trainable, c.freeze, train_indexer=False)]
    what = ", ".join(k.replace("_", " ") for k in stored)
    if c.base_quant == "fp8" and training:
        why = (
            "full fine-tuning trains every weight" if not lora else f"--trainable {c.trainable!r} trains them"
        )
        raise SetupError(f"{option}: the block-FP8 weights stay frozen, and {why}: {len(training)} tensor(s), e.g. "
                         f"{', '.join(training[:3])}; use --base-quant none (dequantised at load)")  # fmt: skip
    if c.base_quant == "none" or (c.base_quant == "auto" and (not lora or training)):
        why = "" if c.base_quant == "none" else (" (full fine-tuning trains them)" if not lora else
                                                 f" (--trainable {c.trainable!r} trains some)")  # fmt: skip
        return BaseQuant(line=f"base: {what} stored in block-FP8 {block[0]}x{block[1]}, dequantised at load "
                              f"(--base-quant {c.base_quant}{why})")  # fmt: skip
    return BaseQuant(stored, block, f"base: {what} kept in block-FP8 {block[0]}x{block[1]} as stored, frozen, "
                                    f"dequantised tile by tile in the GEMMs (--base-quant {c.base_quant})")  # fmt: skip


def _native_names(cfg: Glm53Config, mtp: bool, kinds: tuple[str, ...]) -> list[str]:
    """The native tensors of the module kinds `kinds` (for the --trainable check)."""
    out: dict[str, None] = {}
    for released, placements in released_layout(cfg, mtp=mtp).items():
        if tensor_kind(released, cfg) in kinds:
            out.update(dict.fromkeys(p.native for p in placements))
    return list(out)


def announce_resume(recorded: dict[str, object] | None, quant: BaseQuant) -> str | None:
    """A line when a resumed run keeps its base another way than the checkpoint's run did."""
    before = str((recorded or {}).get("kept", DENSE_KEPT))
    if recorded is None or before == quant.kept:
        return None
    return (
        f"--base-quant: the checkpoint's run kept its base {before.replace('_', '-')}, this run keeps it "
        f"{quant.kept.replace('_', '-')} (the same values: the dequantised base's)"
    )
