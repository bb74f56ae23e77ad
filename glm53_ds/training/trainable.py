"""Which parameters a run trains: full fine-tuning, LoRA (the adapters only), or the names a pattern picks.

In order: with LoRA every parameter but the adapters is frozen; `--trainable REGEX` makes the matching native names
train (without LoRA: only those); `--freeze REGEX` freezes the matching ones, last. The DSA indexer trains only
by its own loss (`--indexer-loss-coef > 0`; the LM loss gives it no gradient through its discrete selection), so it
stays frozen without it whatever the patterns say. Frozen parameters (`requires_grad=False`) are out of the
optimizer, ZeRO's buffers and the gradient norm, with no fp32 copy (`engine/build.py`, `engine/fp32_params.py`).
"""

from __future__ import annotations

import re

from torch import nn

from ..layers.lora import is_lora_param


def trains(name: str, lora: bool, trainable: str | None, freeze: str | None, train_indexer: bool) -> bool:
    """Whether the parameter of this native name trains, by the rule above."""
    train = is_lora_param(name) if lora else trainable is None
    if trainable is not None and re.search(trainable, name):
        train = True
    if freeze is not None and re.search(freeze, name):
        train = False
    return train and (train_indexer or ".indexer." not in name)


# --trainable for the indexer beside LoRA's adapters: how a LoRA run takes --indexer-loss-coef (option_checks), and
# what the planner assumes of one
INDEXER_PATTERN = r"\.indexer\."


def indexer_loss_trainable(lora: bool, indexer_loss: bool) -> str | None:
    """The --trainable a run with the indexer loss needs for its indexer to train: the indexer's pattern under LoRA
    (the adapters do not target it), none otherwise (what the planner and the dry run assume of such a run)."""
    return INDEXER_PATTERN if lora and indexer_loss else None


# the DSA indexer's tensors, as a decoder layer names them (the MTP layer's and every layer's differ in the prefix)
INDEXER_TENSORS = tuple(f"decoder.layers.0.self_attention.indexer.{t}" for t in (
    "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight", "index_kpool_compress_gate",
    "index_kpool_compress_ape"))  # fmt: skip


def select_trainable(
    model: nn.Module, lora: bool, trainable: str | None, freeze: str | None, train_indexer: bool
) -> str:
    """Set `requires_grad` on every parameter by the rule above; returns one line saying what trains."""
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name, lora, trainable, freeze, train_indexer))
    params = list(model.named_parameters())
    trained = [(n, p) for n, p in params if p.requires_grad]
    adapters = [p for n, p in trained if is_lora_param(n)]
    frozen = sum(p.numel() for _, p in params if not p.requires_grad)
    what = (
        f"LoRA adapters: {len(adapters)} tensors ({sum(p.numel() for p in adapters):,} parameters)"
        if lora
        else ""
    )
    others = [p for n, p in trained if not is_lora_param(n)]
    if others or not lora:
        what += (
            "; " if what else ""
        ) + f"{len(others)} other tensors ({sum(p.numel() for p in others):,} parameters)"
    fp8 = sum(getattr(m, k).numel() for m in model.modules() for k in getattr(m, "block_fp8_layouts", {}))
    return f"trains {what}; frozen {frozen:,} parameters" + (
        f" and {fp8:,} weights in block-FP8" if fp8 else ""
    )
