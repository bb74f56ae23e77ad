"""`Glm53TransformerLayer`: a megatron `TransformerLayer` whose residual is the mHC stream set.

With hyper-connections (every decoder layer), the residual is the stream set `[s, b, n, D]`:
    x, post, comb = attn_hc(streams);  streams = hc_post(attention(input_layernorm(x)), streams, post, comb)
    x, post, comb = ffn_hc(streams);   streams = hc_post(mlp(pre_mlp_layernorm(x)), streams, post, comb)
Stream lifecycle, so that a stock megatron `TransformerBlock` / `GPTModel` runs it: the first decoder layer
(`expands_streams`) takes the embedding `[s, b, D]` and copies it into n streams; every mHC layer returns the
streams packed as `[s*n, b, D]` (`mhc.pack_streams`, a re-view of the same memory: megatron hands 3-D
`[seq, batch, hidden]` tensors between layers and pipeline stages) and unpacks its input; the block's final norm
(`StreamMeanRMSNorm`) averages the streams. Without hyper-connections (the MTP layer) it is an ordinary pre-norm
residual layer on `[s, b, D]`.

Masks: `layers/masks.py` reduces transformers' `[b, s]`, megatron's `[b, 1, s, s]` attention mask and megatron's
`padding_mask` to the key-padding mask the attention modules take.

The attention returns `(output, selection)`: a DSA layer's top-k token selection travels to the next layer
through megatron's block-level `context` argument (HF's `prev_topk_indices`).

Selective recompute: `recompute_granularity="selective"` with "mhc" in `recompute_modules` (carried as
`config.recompute_mhc`) recomputes the mHC pre/post in backward instead of storing their fp32 intermediates;
"mlp"/"moe" recompute the FFN. Other megatron module names are accepted and have no effect on GLM layers.
Full recompute is megatron's (`TransformerBlock._checkpointed_forward`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch.utils.checkpoint import checkpoint

from .layers.block_fp8 import DENSE, mlp_linears
from .layers.documents import Documents
from .layers.masks import token_mask
from .layers.moe import Glm53MoE
from .layers.token_tiles import mhc_tile_rows, over_token_tiles, tile_rows
from .mhc import expand_streams, hc_post, pack_streams, unpack_streams
from .parallel.sequence import SequenceParallel


@dataclass
class Glm53LayerSubmodules(TransformerLayerSubmodules):
    attn_hc: ModuleSpec | type | None = None
    ffn_hc: ModuleSpec | type | None = None


class Glm53TransformerLayer(TransformerLayer):
    def __init__(
        self,
        config,
        submodules: Glm53LayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection=None,
        vp_stage: int | None = None,
        expands_streams: bool = False,
    ) -> None:
        # megatron's TransformerLayer hands its process groups only to megatron's own MoE classes; the GLM MoE is
        # built here with them instead, so it never reads global parallel state.
        mlp_spec, mlp_class = submodules.mlp, _module_class(submodules.mlp)
        glm_moe = mlp_class is not None and issubclass(mlp_class, Glm53MoE)
        if glm_moe:
            submodules = dataclasses.replace(submodules, mlp=IdentityOp)  # type: ignore[call-arg]
        elif (fp8 := mlp_linears(config, DENSE)) and isinstance(mlp_spec, ModuleSpec) and mlp_class is MLP:
            # the dense MLP's frozen weights kept in the checkpoint's block-FP8 (--base-quant fp8)
            linears = MLPSubmodules(linear_fc1=fp8[0], linear_fc2=fp8[1])
            submodules = dataclasses.replace(submodules, mlp=ModuleSpec(module=MLP, submodules=linears))  # type: ignore[call-arg]
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        if glm_moe:
            self.mlp = build_module(mlp_spec, config=self.config, pg_collection=self.pg_collection)
        # a dense MLP over tiles of tokens under the MoE's tile budget (layers/token_tiles.py); the GLM MoE tiles its
        # routed and shared experts itself
        self.mlp_tile_tokens = (
            2**62
            if glm_moe
            else tile_rows(getattr(config, "moe_tile_bytes", 0), config.hidden_size, config.ffn_hidden_size,
                           torch.empty((), dtype=config.params_dtype).element_size())
        )  # fmt: skip
        self.hc_post = functools.partial(hc_post, backend=config.hc_post_impl)
        # the mHC mixes over tiles of tokens under the same budget (their fp32 transients: layers/token_tiles.py)
        self.mhc_tile_tokens = mhc_tile_rows(getattr(config, "moe_tile_bytes", 0), config.glm.hc_mult,
                                             config.hidden_size)  # fmt: skip
        # fn in the model dtype, as HF keeps it (base/scale stay fp32 inside HyperConnection)
        hc_kwargs = dict(fn_dtype=config.params_dtype, sinkhorn_impl=config.sinkhorn_impl)
        self.attn_hc = (
            build_module(submodules.attn_hc, **hc_kwargs) if submodules.attn_hc is not None else None
        )
        self.ffn_hc = build_module(submodules.ffn_hc, **hc_kwargs) if submodules.ffn_hc is not None else None
        if (self.attn_hc is None) != (self.ffn_hc is None):
            raise ValueError("Glm53TransformerLayer needs both attn_hc and ffn_hc, or neither")
        if expands_streams and self.attn_hc is None:
            raise ValueError("expands_streams needs a layer with hyper-connections")
        self.expands_streams = expands_streams
        self.hc_mult = config.glm.hc_mult
        selective = config.recompute_granularity == "selective"
        modules = set(config.recompute_modules or []) if selective else set()
        self.recompute_mhc = selective and bool(getattr(config, "recompute_mhc", False))
        self.recompute_ffn = bool(modules & {"mlp", "moe"})
        sequence = SequenceParallel.of(self.pg_collection)
        self.sp_size = 1 if sequence is None else sequence.size

    @property
    def uses_mhc(self) -> bool:
        return self.attn_hc is not None

    def _maybe_recompute(self, enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
        if enabled and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _sublayer(self, hc, norm, block, streams, **block_kwargs):
        """One residual sub-block (attention or FFN) around `streams`; returns (new streams, block extras)."""
        if hc is None:
            out, extra = _split(block(norm(streams), **block_kwargs))
            return streams + out, extra
        # over tiles of tokens, each tile a checkpoint (so recomputed, with or without recompute_mhc)
        tiles = streams.shape[0] * streams.shape[1] > self.mhc_tile_tokens
        if tiles:
            collapsed, post, comb = over_token_tiles(hc, streams, self.mhc_tile_tokens)
        else:
            collapsed, post, comb = self._maybe_recompute(self.recompute_mhc, hc, streams)
        out, extra = _split(block(norm(collapsed), **block_kwargs))
        if tiles:
            return over_token_tiles(self.hc_post, out, self.mhc_tile_tokens, streams, post, comb), extra
        return self._maybe_recompute(self.recompute_mhc, self.hc_post, out, streams, post, comb), extra

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        trailing_padding: int | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states: the embedding [s, b, D] (first layer), packed streams [s*n, b, D] (or [s, b, n, D]), or
        [s, b, D] without mHC; attention_mask / padding_mask in any convention of layers/masks.py; context: the
        previous DSA layer's selection; packed_seq_params: packed documents of the whole row (layers/documents.py),
        which the attention modules take; trailing_padding: a host-known mask shape for the attention (SparseMLA).
        Returns (packed streams or [s, b, D], selection for the next layer)."""
        if not self.uses_mhc:
            streams = hidden_states
        elif self.expands_streams:
            streams = expand_streams(hidden_states, self.hc_mult)  # [s, b, D] -> [s, b, n, D]
        else:
            streams = unpack_streams(hidden_states, self.hc_mult)
        s, b = streams.shape[:2]
        tokens = token_mask(attention_mask, padding_mask, b, s, validate=self.expands_streams)
        attention = self.self_attention
        if packed_seq_params is not None:
            if not getattr(self.self_attention, "accepts_documents", False):
                raise ValueError(
                    f"{type(self.self_attention).__name__} does not take packed documents (packed_seq_params)"
                )
            # the whole row's documents (under sequence parallelism this rank holds s of its s * SP tokens): tensor
            # code over the documents' tensors, inside the compiled layer's graph
            documents = Documents.from_packed_seq_params(packed_seq_params, s * self.sp_size, b)
            attention = functools.partial(self.self_attention, documents=documents)
        if trailing_padding is not None:
            attention = functools.partial(attention, trailing_padding=trailing_padding)
        streams, selection = self._sublayer(
            self.attn_hc, self.input_layernorm, attention, streams, attention_mask=tokens, shared_topk=context
        )

        def mlp(x: torch.Tensor) -> torch.Tensor:
            return _split(self.mlp(x))[0]

        def ffn(x: torch.Tensor) -> torch.Tensor:
            return over_token_tiles(mlp, x, self.mlp_tile_tokens)

        def ffn_maybe_recomputed(x: torch.Tensor) -> torch.Tensor:
            return self._maybe_recompute(self.recompute_ffn, ffn, x)

        streams, _ = self._sublayer(self.ffn_hc, self.pre_mlp_layernorm, ffn_maybe_recomputed, streams)
        return (pack_streams(streams) if self.uses_mhc else streams), selection


def _module_class(spec: Any) -> type | None:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return module if isinstance(module, type) else None


def _split(result: Any) -> tuple[torch.Tensor, Any]:
    """Megatron modules return (output, bias-or-extra); plain callables return the tensor."""
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, None
