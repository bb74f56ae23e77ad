"""GLM-5.3-Flash text configuration, read from a `glm5_next` `config.json`.

`Glm53Config.from_hf` accepts the released layout (text fields nested under `text_config`), a flat text-only
config, a path to either (directory or file), or the dict itself. The defaults and the derived per-layer
schedules (`layer_types`, `mlp_layer_types`, `indexer_types`) follow `transformers==5.23.0`
`Glm5NextTextConfig.__post_init__` so that a config HF accepts means the same model here. Every value the model
reads is validated up front; a bad one raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# model_type values that describe the GLM-5.3-Flash text model (the multimodal wrapper and the text config).
HF_MODEL_TYPES = ("glm5_next", "glm5_next_text")
LAYER_TYPES = ("linear_attention", "indexed_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
# Default MTP loss weight when the config has none (DeepSeek-V3 uses 0.3 for the first part of training).
DEFAULT_MTP_LOSS_WEIGHT = 0.3


@dataclass
class Glm53Config:
    # Sizes
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    max_position_embeddings: int = 1048576
    # MLA (NoPE) attention
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    attention_dropout: float = 0.0
    # DSA k-pool indexer
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # KDA linear attention
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    # MoE
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    router_aux_loss_coef: float = 0.001
    # MLP
    hidden_act: str = "silu"
    swiglu_limit: float | None = 10.0
    # Manifold-constrained hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # Norms, init, tokens
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    # Per-layer schedules (derived as HF does when absent)
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    indexer_types: list[str] = field(default_factory=list)
    # Multi-token prediction: one DeepSeek-V3 style MTP layer stored at checkpoint index num_hidden_layers.
    num_nextn_predict_layers: int = 1
    mtp_loss_weight: float = DEFAULT_MTP_LOSS_WEIGHT

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            if not self.layer_types:
                self.layer_types = [
                    "linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)
                ]
            if not self.mlp_layer_types:
                self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
            if not self.indexer_types:
                self.indexer_types = _indexer_schedule(n, pattern=None, freq=1, offset=2)
        self.layer_types = [
            "indexed_attention" if t == "full_attention" else t for t in list(self.layer_types)
        ]
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.indexer_types = list(self.indexer_types)
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_local_experts(self) -> int:
        return self.n_routed_experts

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(
        cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any], **overrides: Any
    ) -> Glm53Config:
        """Read a `glm5_next` config: a model directory, a `config.json` path, or the parsed dict.

        `overrides` replace text fields after reading (e.g. `mtp_loss_weight=0.1`).
        """
        if isinstance(path_or_dict, Mapping):
            raw: dict[str, Any] = dict(path_or_dict)
            source = "<dict>"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path!r}")
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            source = path

        model_type = raw.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not a GLM-5.3 config; expected one of {HF_MODEL_TYPES}"
            )
        text = raw.get("text_config")
        if text is None:
            text = raw  # flat, text-only layout
        elif not isinstance(text, Mapping):
            raise ValueError(f"{source}: text_config must be an object, got {type(text).__name__}")
        else:
            text = dict(text)
            # Some wrappers keep tie_word_embeddings only at the top level.
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return cls.from_text_dict(text, **overrides)

    @classmethod
    def from_text_dict(cls, text: Mapping[str, Any], **overrides: Any) -> Glm53Config:
        """Build from the text fields alone, applying HF's aliases and legacy keys."""
        text = dict(text)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in text.items() if k in known}
        if "num_local_experts" in text and "n_routed_experts" not in text:
            kwargs["n_routed_experts"] = text["num_local_experts"]
        if kwargs.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        # Legacy nested KDA settings, as HF reads them.
        linear = text.get("linear_attn_config")
        if isinstance(linear, Mapping):
            kwargs["linear_head_dim"] = linear.get("head_dim", kwargs.get("linear_head_dim", 128))
            kwargs["linear_num_heads"] = linear.get("num_heads", kwargs.get("linear_num_heads", 64))
            kwargs["linear_conv_kernel_dim"] = linear.get(
                "short_conv_kernel_size", kwargs.get("linear_conv_kernel_dim", 4)
            )
            lower = linear.get("gate_lower_bound", kwargs.get("linear_lower_bound", -5.0))
            if linear.get("safe_gate", True) and lower is None:
                lower = -5.0
            kwargs["linear_lower_bound"] = lower
        # Indexer schedule from the legacy pattern / frequency keys when no explicit list is given.
        if not kwargs.get("indexer_types"):
            n = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
            if isinstance(n, int) and n >= 0:
                kwargs["indexer_types"] = _indexer_schedule(
                    n,
                    pattern=text.get("index_topk_pattern"),
                    freq=text.get("index_topk_freq", 1),
                    offset=text.get("index_skip_topk_offset", 2),
                )
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        if kwargs.get("mtp_loss_weight") is None:
            kwargs.pop("mtp_loss_weight", None)
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown config override(s): {sorted(unknown)}")
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_text_dict(self) -> dict[str, Any]:
        """The text fields as HF writes them under `text_config` (plus this project's MTP fields)."""
        d = dataclasses.asdict(self)
        d["model_type"] = "glm5_next_text"
        d["qk_head_dim"] = self.qk_head_dim
        d["head_dim"] = self.qk_rope_head_dim
        return d

    def replace(self, **changes: Any) -> Glm53Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        positive_ints = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "index_topk",
            "index_head_dim",
            "index_n_heads",
            "index_kpool",
            "linear_head_dim",
            "linear_num_heads",
            "linear_conv_kernel_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "hc_mult",
            "hc_sinkhorn_iters",
            "max_position_embeddings",
        )
        for name in positive_ints:
            _require_int(self, name, minimum=1)
        for name in ("num_hidden_layers", "n_shared_experts", "qk_rope_head_dim", "num_nextn_predict_layers"):
            _require_int(self, name, minimum=0)
        for name in ("rms_norm_eps", "hc_eps"):
            _require_float(self, name, positive=True)
        for name in ("routed_scaling_factor", "initializer_range", "router_aux_loss_coef", "mtp_loss_weight"):
            _require_float(self, name, positive=False)
        if not 0.0 <= float(self.attention_dropout) < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        if self.swiglu_limit is not None:
            _require_float(self, "swiglu_limit", positive=True)
        if self.linear_lower_bound is not None:
            _require_float(self, "linear_lower_bound", positive=False)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (GLM-5.3 uses 'silu')")

        if self.num_attention_heads != self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must equal num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.qk_rope_head_dim != 0:
            raise ValueError(
                f"qk_rope_head_dim must be 0 (GLM-5.3 attention is NoPE), got {self.qk_rope_head_dim}"
            )
        if self.index_topk % self.index_kpool != 0:
            raise ValueError(
                f"index_topk ({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})"
            )
        if self.n_routed_experts % self.n_group != 0:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})")
        experts_per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and experts_per_group < 2:
            raise ValueError(
                f"n_group ({self.n_group}) leaves {experts_per_group} expert(s) per group; group scores "
                "sum the top-2 experts of each group, so each group needs at least 2"
            )
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts reachable through "
                f"topk_group ({self.topk_group}) groups of {experts_per_group}"
            )

        n = self.num_hidden_layers
        _require_schedule(self, "layer_types", LAYER_TYPES, n)
        _require_schedule(self, "mlp_layer_types", MLP_LAYER_TYPES, n)
        _require_schedule(self, "indexer_types", INDEXER_TYPES, n)
        # HF hands a full indexer layer's selection only to the very next layer, and only to an indexed layer:
        # a shared indexed layer anywhere else has nothing to reuse and fails in HF's forward.
        for i in range(n):
            if self.layer_types[i] == "indexed_attention" and self.indexer_types[i] == "shared":
                prev_ok = (
                    i > 0
                    and self.layer_types[i - 1] == "indexed_attention"
                    and self.indexer_types[i - 1] == "full"
                )
                if not prev_ok:
                    raise ValueError(
                        f"indexer_types[{i}] is 'shared' but layer {i - 1} is not a 'full' indexed_attention "
                        "layer, so there is no top-k selection to reuse"
                    )


def _indexer_schedule(n: int, pattern: Any, freq: Any, offset: Any) -> list[str]:
    """HF's indexer schedule: an explicit pattern ("FSSF..." or a list), else every `freq`-th layer is full."""
    if pattern is not None:
        if isinstance(pattern, str):
            mapping = {"F": "full", "S": "shared"}
            bad = sorted(set(pattern) - set(mapping))
            if bad:
                raise ValueError(f"index_topk_pattern has unknown letters {bad}; expected 'F' or 'S'")
            return [mapping[c] for c in pattern]
        return list(pattern)
    freq = max(int(freq), 1)
    offset = int(offset)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]


def _require_int(cfg: Glm53Config, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _require_float(cfg: Glm53Config, name: str, positive: bool) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _require_schedule(cfg: Glm53Config, name: str, allowed: tuple[str, ...], n: int) -> None:
    values = getattr(cfg, name)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but num_hidden_layers is {n}")
    for i, v in enumerate(values):
        if v not in allowed:
            raise ValueError(f"{name}[{i}]={v!r} is not one of {allowed}")
