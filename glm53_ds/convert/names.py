"""The one table between the released Hugging Face layout and glm53_ds's parameter names.

`released_layout(cfg, mtp)` lists every text tensor of a released GLM-5.3 checkpoint (the names
`transformers` writes with `save_pretrained`, under `model.language_model.` plus `lm_head.weight`) and, for each,
where it lives in the native state dict: a `Placement(native key, index into the native tensor)`. Several
released tensors can fill one native tensor (per-expert `gate_proj`/`up_proj` -> `experts.gate_up_proj[e]`,
dense `gate_proj`/`up_proj` -> `linear_fc1`), and the reverse direction reads the same table.

`split_to_released(name, tensor, cfg)` turns the names `transformers` uses in memory (`attn_hc.fn`,
`forget_gate.*`, concatenated `conv1d`, fused `experts.gate_up_proj`/`down_proj`) into released ones, so
both spellings load.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..config import Glm53Config

TEXT_PREFIX = "model.language_model."
HEAD_NAME = "lm_head.weight"
# Other prefixes a text checkpoint may use (text-only saves).
ACCEPTED_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


@dataclass(frozen=True)
class Placement:
    native: str
    index: tuple[int | slice, ...] = ()


_KDA_WEIGHTS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj", "q_conv1d", "k_conv1d",
                "v_conv1d", "o_norm")  # fmt: skip
_MLA_WEIGHTS = (
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
_INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
                    "index_kpool_compress_ape", "index_kpool_compress_gate")  # fmt: skip


def _attention(cfg: Glm53Config, hf: str, native: str, linear: bool) -> Iterator[tuple[str, list[Placement]]]:
    if linear:
        for w in _KDA_WEIGHTS:
            yield f"{hf}.self_attn.{w}.weight", [Placement(f"{native}.self_attention.{w}.weight")]
        for w in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            yield f"{hf}.self_attn.{w}", [Placement(f"{native}.self_attention.forget_gate.{w}")]
    else:
        for w in _MLA_WEIGHTS:
            yield f"{hf}.self_attn.{w}.weight", [Placement(f"{native}.self_attention.{w}.weight")]


def _indexer(hf: str, native: str) -> Iterator[tuple[str, list[Placement]]]:
    for t in _INDEXER_TENSORS:
        yield f"{hf}.self_attn.indexer.{t}", [Placement(f"{native}.self_attention.indexer.{t}")]


def _swiglu(hf: str, native: str, inner: int) -> Iterator[tuple[str, list[Placement]]]:
    """gate_proj / up_proj stacked into megatron's linear_fc1 (gate rows first), down_proj -> linear_fc2."""
    yield f"{hf}.gate_proj.weight", [Placement(f"{native}.linear_fc1.weight", (slice(0, inner),))]
    yield f"{hf}.up_proj.weight", [Placement(f"{native}.linear_fc1.weight", (slice(inner, 2 * inner),))]
    yield f"{hf}.down_proj.weight", [Placement(f"{native}.linear_fc2.weight")]


def _moe(cfg: Glm53Config, hf: str, native: str) -> Iterator[tuple[str, list[Placement]]]:
    inner = cfg.moe_intermediate_size
    yield f"{hf}.mlp.gate.weight", [Placement(f"{native}.mlp.router.weight")]
    yield (
        f"{hf}.mlp.gate.e_score_correction_bias",
        [Placement(f"{native}.mlp.router.e_score_correction_bias")],
    )
    for e in range(cfg.n_routed_experts):
        yield (
            f"{hf}.mlp.experts.{e}.gate_proj.weight",
            [Placement(f"{native}.mlp.experts.gate_up_proj", (e, slice(0, inner)))],
        )
        yield (
            f"{hf}.mlp.experts.{e}.up_proj.weight",
            [Placement(f"{native}.mlp.experts.gate_up_proj", (e, slice(inner, 2 * inner)))],
        )
        yield f"{hf}.mlp.experts.{e}.down_proj.weight", [Placement(f"{native}.mlp.experts.down_proj", (e,))]
    if cfg.n_shared_experts > 0:
        yield from _swiglu(
            f"{hf}.mlp.shared_experts", f"{native}.mlp.shared_experts", inner * cfg.n_shared_experts
        )


def released_layout(cfg: Glm53Config, mtp: bool) -> dict[str, list[Placement]]:
    """Every released text tensor name -> its placements in the native state dict, in checkpoint order."""
    out: dict[str, list[Placement]] = {}
    p = TEXT_PREFIX
    out[f"{p}embed_tokens.weight"] = [Placement("embedding.weight")]
    for i in range(cfg.num_hidden_layers):
        hf, native = f"{p}layers.{i}", f"decoder.layers.{i}"
        for site in ("attn", "ffn"):
            for t in ("fn", "base", "scale"):
                out[f"{hf}.hc_{site}_{t}"] = [Placement(f"{native}.{site}_hc.{t}")]
        out[f"{hf}.input_layernorm.weight"] = [Placement(f"{native}.input_layernorm.weight")]
        out[f"{hf}.post_attention_layernorm.weight"] = [Placement(f"{native}.pre_mlp_layernorm.weight")]
        linear = cfg.layer_types[i] == "linear_attention"
        out.update(_attention(cfg, hf, native, linear))
        if not linear and cfg.indexer_types[i] == "full":
            out.update(_indexer(hf, native))
        if cfg.mlp_layer_types[i] == "sparse":
            out.update(_moe(cfg, hf, native))
        else:
            out.update(_swiglu(f"{hf}.mlp", f"{native}.mlp", cfg.intermediate_size))
    out[f"{p}norm.weight"] = [Placement("final_norm.weight")]
    if mtp:
        for d in range(cfg.num_nextn_predict_layers):
            hf, native = f"{p}layers.{cfg.num_hidden_layers + d}", f"mtp.{d}"
            layer = f"{native}.transformer_layer"
            for t in ("enorm", "hnorm", "eh_proj"):
                out[f"{hf}.{t}.weight"] = [Placement(f"{native}.{t}.weight")]
            out[f"{hf}.input_layernorm.weight"] = [Placement(f"{layer}.input_layernorm.weight")]
            out[f"{hf}.post_attention_layernorm.weight"] = [Placement(f"{layer}.pre_mlp_layernorm.weight")]
            out.update(_attention(cfg, hf, layer, linear=False))
            out.update(_indexer(hf, layer))
            out.update(_moe(cfg, hf, layer))
            out[f"{hf}.shared_head.norm.weight"] = [Placement(f"{native}.final_layernorm.weight")]
    out[HEAD_NAME] = [Placement("output_layer.weight")]
    if cfg.tie_word_embeddings:
        del out[HEAD_NAME]
    return out


def mtp_layer_indices(cfg: Glm53Config) -> range:
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def is_mtp_name(name: str, cfg: Glm53Config) -> bool:
    """Whether a (released or stored) text tensor name belongs to an MTP layer (`layers.<num_hidden_layers + d>.`)."""
    canonical = canonical_text_name(name)
    prefixes = tuple(f"layers.{i}." for i in mtp_layer_indices(cfg))
    return canonical is not None and canonical.split("language_model.", 1)[-1].startswith(prefixes)


# Duplicates some DeepSeek-style checkpoints store inside the MTP layer; glm53_ds shares the main ones.
_RELEASED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def released_expert(name: str) -> tuple[int, str] | None:
    """(expert index, 'gate_proj' | 'up_proj' | 'down_proj') of a released per-expert tensor name, else None."""
    m = _RELEASED_EXPERT.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


_MTP_SHARED_DUPLICATES = re.compile(r"layers\.(\d+)\.(embed_tokens\.weight|shared_head\.head\.weight)$")


def is_mtp_shared_duplicate(name: str, cfg: Glm53Config) -> bool:
    m = _MTP_SHARED_DUPLICATES.search(name)
    return m is not None and int(m.group(1)) in mtp_layer_indices(cfg)


def canonical_text_name(name: str) -> str | None:
    """The released spelling of a text tensor name's prefix, or None for vision / non-text tensors."""
    if name == HEAD_NAME:
        return name
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix in ACCEPTED_TEXT_PREFIXES:
        if name.startswith(prefix):
            return TEXT_PREFIX + name[len(prefix) :]
    return TEXT_PREFIX + name if name.startswith(("layers.", "embed_tokens.", "norm.")) else name


# In-memory (transformers) spellings that are plain renames of released names.
_RENAMES = [
    (re.compile(r"\.attn_hc\.(fn|base|scale)$"), r".hc_attn_\1"),
    (re.compile(r"\.ffn_hc\.(fn|base|scale)$"), r".hc_ffn_\1"),
    (
        re.compile(r"\.self_attn\.forget_gate\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$"),
        r".self_attn.\1",
    ),
]


def in_memory_module(released: str) -> str:
    """The transformers module a released projection weight (`....weight`) belongs to in memory: the same path,
    but the KDA forget gate's projections live in a `forget_gate` submodule."""
    module = released.removesuffix(".weight")
    return re.sub(r"\.self_attn\.(f_a_proj|f_b_proj)$", r".self_attn.forget_gate.\1", module)


def split_to_released(name: str, tensor: torch.Tensor, cfg: Glm53Config) -> list[tuple[str, torch.Tensor]]:
    """Released (name, tensor) pieces of one input tensor, whatever spelling it uses."""
    for pattern, repl in _RENAMES:
        if pattern.search(name):
            return [(pattern.sub(repl, name), tensor)]
    if name.endswith(".self_attn.conv1d.weight"):  # concatenated q|k|v short convs [3K, 1, k] (or [3K, k])
        base = name[: -len("conv1d.weight")]
        parts = tensor.chunk(3, dim=0)
        return [
            (f"{base}{w}_conv1d.weight", t.reshape(t.shape[0], 1, -1))
            for w, t in zip("qkv", parts, strict=True)
        ]
    if name.endswith(".mlp.experts.gate_up_proj"):  # fused [E, 2I, D]
        base = name[: -len("gate_up_proj")]
        inner = tensor.shape[1] // 2
        out = []
        for e in range(tensor.shape[0]):
            out.append((f"{base}{e}.gate_proj.weight", tensor[e, :inner]))
            out.append((f"{base}{e}.up_proj.weight", tensor[e, inner:]))
        return out
    if name.endswith(".mlp.experts.down_proj"):  # fused [E, D, I]
        base = name[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def released_tensors(
    state: dict[str, torch.Tensor], cfg: Glm53Config, mtp: bool, names: list[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) read out of a native state dict, in checkpoint order (or for `names` only)."""
    layout = released_layout(cfg, mtp=mtp)
    for name in layout if names is None else names:
        pieces = [state[p.native][p.index] if p.index else state[p.native] for p in layout[name]]
        yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces)
