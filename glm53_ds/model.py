"""`Glm53Model`: GLM-5.3-Flash text model on megatron-core.

    input_ids [b, s] -> embedding [s, b, D] -> TransformerBlock (the GLM-5.3 block spec: the first layer expands
    the hc_mult streams, layers hand them on packed [s*n, b, D]) -> final_norm.stream_mean [s, b, D]
    -> final_norm (RMSNorm) -> output layer -> logits [b, s, V] (fp32)      (+ MTP on the stream mean, layers/mtp.py)

The decoder is built from the same spec a stock megatron `GPTModel` uses (specs.py); the block's final norm is
built from the spec's `layer_norm` as `final_norm` here, outside the block, because MTP reads the stream mean
before it (docs/mtp.md). Parameter names are the native checkpoint names (convert/names.py).

`model(input_ids, attention_mask=None, labels=None)` returns logits, or the loss when labels are given
(HF convention: labels aligned with input_ids, shifted inside; -100 ignored). With MTP the loss is
`lm_loss + mtp_loss_weight * mean_k(mtp_loss_k)` (+ the MoE sequence auxiliary losses when
`moe_seq_aux_loss_coef > 0`); `return_parts=True` returns them as a `LossParts` of tensors instead (nothing
in the forward pass waits for the host; the caller reads the values when it logs).
Process groups come in as megatron's `pg_collection` (the layout's); without one, megatron's global state.

Sequence parallelism (`pg_collection.sp`, parallel/sequence.py): every rank of an SP group of N is handed the
same whole rows (input_ids, labels, masks, cu_seqlens: a few bytes per token) and computes its contiguous 1/N of
the tokens; the targets of its last positions and the MTP inputs come from the whole rows, so they are exact across
shard boundaries. Its loss is its shard's token sum over the whole batch's target count (or the given
`token_normalizers`): the sum over the SP group is the loss of the rows, and so are the gradients (the engine sums
them over SP). Logits, `mtp_logits` and `count_targets` are the local shard's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import host_reads
from .config import Glm53Config
from .layers.activation_offload import ActivationOffload
from .layers.chunked_ce import IGNORE_INDEX, linear_cross_entropy
from .layers.documents import Documents, check_cu_seqlens_type
from .layers.forward_record import ForwardRecord, recording
from .layers.linear import ColumnLinear
from .layers.mtp import Glm53MtpLayer, shift_left
from .parallel import ensure_model_parallel
from .parallel.sequence import SequenceParallel
from .specs import get_glm53_block_spec, get_glm53_mtp_block_spec
from .transformer_config import Glm53TransformerConfig, make_transformer_config


@dataclass
class LossParts:
    """The training loss and its parts, as tensors (0-d; `mtp` / `aux` None when the model has none)."""

    total: torch.Tensor
    lm: torch.Tensor
    mtp: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    indexer: torch.Tensor | None = (
        None  # the DSA indexers' KL loss (summed over full-indexer layers), unweighted
    )
    record: ForwardRecord | None = (
        None  # everything the layers handed out (per-layer losses, tokens per expert)
    )

    def detached(self) -> dict[str, torch.Tensor]:
        """The parts to log, detached: lm_loss, and mtp_loss / aux_loss when present."""
        out = {"lm_loss": self.lm.detach()}
        if self.mtp is not None:
            out["mtp_loss"] = self.mtp.detach()
        if self.aux is not None:
            out["aux_loss"] = self.aux.detach()
        if self.indexer is not None:
            out["indexer_loss"] = self.indexer.detach()
        return out


class Glm53Model(nn.Module):
    # Tensors HF keeps in fp32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict for glm5_next);
    # glm53_ds builds them in fp32. DeepSpeed 0.19.8's bf16 cast reads this attribute but keeps only buffers (the
    # router bias) in fp32; glm53_ds.build_engine turns the parameters into fp32 buffers it never casts
    # (engine/fp32_params.py), with their own reduction and optimizer.
    _keep_in_fp32_modules_strict = [
        "e_score_correction_bias",
        "conv1d",
        "dt_bias",
        "A_log",
        "attn_hc.base",
        "attn_hc.scale",
        "ffn_hc.base",
        "ffn_hc.scale",
    ]

    # the output layer + cross entropy of every head in one call (glm53_ds/compile.py compiles it per model)
    loss_head = staticmethod(linear_cross_entropy)

    def __init__(
        self,
        config: Glm53TransformerConfig,
        mtp: bool | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        cfg = config.glm
        self.config = config
        self.glm = cfg
        self.sequence = SequenceParallel.of(pg_collection)  # None without sequence parallelism
        self.embedding = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, init_method=config.init_method, config=config
        )
        freeze_padding_row(self.embedding.weight, cfg)
        block_spec = get_glm53_block_spec(cfg)
        self.decoder = TransformerBlock(
            config, block_spec, post_layer_norm=False, pg_collection=pg_collection
        )
        self.final_norm = build_module(
            block_spec.layer_norm, config=config, hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps
        )
        self.output_layer = ColumnLinear(config, cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.output_layer.weight = self.embedding.weight
        use_mtp = cfg.num_nextn_predict_layers > 0 if mtp is None else mtp
        self.mtp = (
            nn.ModuleList(
                build_module(
                    spec, config=config, layer_number=depth, pg_collection=pg_collection, standalone=True
                )
                for depth, spec in enumerate(get_glm53_mtp_block_spec(cfg).layer_specs, start=1)
            )
            if use_mtp
            else None
        )
        # full recompute's kept layer inputs in host memory between forward and backward (--offload-activations)
        self.activation_offload = ActivationOffload() if config.offload_activations else None

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_tokens: torch.Tensor | None = None,
        return_parts: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        token_normalizers: Sequence[float] | torch.Tensor | None = None,
    ) -> torch.Tensor | LossParts:
        """`next_tokens [b, m]` (optional) continue `labels` past the input, so that the last positions get
        targets too (training windows of seq_length + 1 tokens: input = window[:-1], labels = window[:-1],
        next_tokens = window[-1:]). With labels: the loss, or all its parts with `return_parts=True`.
        `cu_seqlens [n_docs + 1]` (0 ... s, increasing; batch 1): packed documents, each computed exactly as if it
        were alone (layers/documents.py); no target and no MTP input crosses a boundary.
        `token_normalizers` (LM, then each MTP depth): divide each loss's token sum by these instead of this
        batch's own target counts, so that micro-batch losses add up to the global batch's token mean
        (docs/numerics.md; `count_targets` gives the counts).

        Host syncs: one, the input check's read (`_check_inputs`: the token range, whether the mask has padding, the
        packed boundaries); a padded batch adds one per full DSA layer (tests/test_host_syncs.py). The auxiliary
        losses come back as values (`layers/forward_record.py`), nothing is left on the modules."""
        with recording() as record:
            return self._forward(record, input_ids, attention_mask, labels, next_tokens, return_parts, cu_seqlens,
                                 token_normalizers)  # fmt: skip

    def _forward(
        self,
        record: ForwardRecord,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        next_tokens: torch.Tensor | None,
        return_parts: bool,
        cu_seqlens: torch.Tensor | None,
        token_normalizers: Sequence[float] | torch.Tensor | None,
    ) -> torch.Tensor | LossParts:
        mask, all_real, docs = self._check_inputs(input_ids, attention_mask, labels, cu_seqlens)
        if next_tokens is not None and labels is not None:
            labels = torch.cat([labels, next_tokens.to(labels.dtype)], dim=1)
        # a trained embedding looks the MTP depths' next tokens up with the input: one [V, D] gradient, at the end of
        # the backward (a lookup per use holds the MTP's through the decoder's backward until the input's arrives);
        # a frozen one (LoRA) has none and looks them up when the MTP runs, not holding them through the decoder
        ids = [input_ids]
        if labels is not None and self.mtp is not None and self.embedding.weight.requires_grad:
            ids += [shift_left(input_ids, depth) for depth in range(1, len(self.mtp) + 1)]
        embedded = self._embed(ids)
        hidden = self._hidden(embedded[0], mask, all_real, docs)  # [s, b, D]
        normed_lm = self.final_norm.normalize(hidden)
        if labels is None:
            return self._logits(normed_lm)
        norms = token_normalizers
        if norms is not None and len(norms) != 1 + (len(self.mtp) if self.mtp is not None else 0):
            raise ValueError(
                f"token_normalizers needs one value for the LM loss and one per MTP depth, got {norms}"
            )
        mtp_loss = None
        normed = [normed_lm]
        if self.mtp is not None:
            normed += self._mtp_normed(hidden, input_ids, embedded[1:], mask, all_real, docs)
        head_losses = self._head_losses(normed, labels, docs, norms)  # [1 + MTP depths]
        loss = lm_loss = head_losses[0]
        if self.mtp is not None:
            mtp_loss = head_losses[1:].mean()
            loss = loss + self.glm.mtp_loss_weight * mtp_loss
        aux_loss, indexer_loss = record.aux_loss(), record.indexer_loss()
        if aux_loss is not None:
            loss = loss + aux_loss
        if indexer_loss is not None:
            loss = loss + self.config.indexer_loss_coef * indexer_loss
        return LossParts(loss, lm_loss, mtp_loss, aux_loss, indexer_loss, record) if return_parts else loss

    def count_targets(
        self,
        labels: torch.Tensor,
        next_tokens: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 [1 + MTP depths]: the number of targets of the LM loss and of each MTP depth in this batch (what
        `forward` divides by without `token_normalizers`); no host sync."""
        docs = None if cu_seqlens is None else Documents.from_cu_seqlens(cu_seqlens, *labels.shape[::-1])
        if next_tokens is not None:
            labels = torch.cat([labels, next_tokens.to(labels.dtype)], dim=1)
        s = labels.shape[1] - (0 if next_tokens is None else next_tokens.shape[1])
        depths = 1 + (len(self.mtp) if self.mtp is not None else 0)
        counts = [
            (self._local(shifted_targets(labels, s, shift, docs)) != IGNORE_INDEX).sum()
            for shift in range(1, depths + 1)
        ]
        return torch.stack(counts)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-row tensor [b, S, ...] (all of it without sequence parallelism)."""
        return x if self.sequence is None else self.sequence.shard(x, dim=1)

    def _head_losses(
        self,
        normed: list[torch.Tensor],
        labels: torch.Tensor,
        docs: Documents | None,
        normalizers: Sequence[float] | torch.Tensor | None,
    ) -> torch.Tensor:
        """The output layer + cross entropy of each head's normed [s, b, D] (the LM's, then MTP depth k's) against
        labels[t + 1 + k]: [1 + depths] losses in one call over chunks (layers/chunked_ce.py: no [tokens, vocab]
        logits are kept, `config.loss_chunk_bytes` sizes a chunk; the shared output layer gets one weight gradient).
        Each is divided by its `normalizers` entry, or by the row's target count over all SP ranks."""
        s, b, d = normed[0].shape
        whole_length = s * (1 if self.sequence is None else self.sequence.size)
        wholes = [shifted_targets(labels, whole_length, shift, docs) for shift in range(1, len(normed) + 1)]
        # this rank's targets, [s * b] each, in the order of normed's rows
        targets = [self._local(whole).t().reshape(-1) for whole in wholes]
        if normalizers is None:  # the rows' target counts, not the shard's
            norm = torch.stack([(whole != IGNORE_INDEX).sum() for whole in wholes])
        else:
            norm = torch.as_tensor(normalizers, dtype=torch.float32, device=labels.device)
        return self.loss_head(
            torch.cat([n.reshape(s * b, d) for n in normed]), self.output_layer.weight, torch.cat(targets),
            norm, chunk_bytes=self.config.loss_chunk_bytes, groups=len(normed),
        ).reshape(len(normed))  # fmt: skip

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.output_layer(normed).float().transpose(0, 1)  # [s, b, V] -> [b, s, V]

    def _embed(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's embeddings [s, b, D] of token ids [b, S] (whole rows), several in one lookup."""
        rows = self.embedding(self._local(torch.cat(ids))).split(ids[0].shape[0])  # [b, s, D] each
        return [x.transpose(0, 1) for x in rows]

    def _hidden(
        self, x: torch.Tensor, mask: torch.Tensor, all_real: bool, docs: Documents | None
    ) -> torch.Tensor:
        """Embedded input [s, b, D] -> decoder (streams) -> stream mean [s, b, D] (before the final norm; MTP
        reads it)."""
        if self.config.recompute_granularity == "full" and torch.is_grad_enabled() and not x.requires_grad:
            # a frozen embedding (LoRA, --freeze) gives hidden states without a gradient; megatron's full recompute
            # (a reentrant checkpoint) would then return outputs without one, and the adapters inside get none
            x = x.detach().requires_grad_()
        packed_seq = None if docs is None else docs.packed_seq_params()
        layer_mask = None if all_real else self._local(mask)  # None: every token is real (known on the host)
        offload = self.activation_offload if torch.is_grad_enabled() else None
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            packed = self.decoder(x, attention_mask=layer_mask, packed_seq_params=packed_seq)  # [s*n, b, D]
        return self.final_norm.stream_mean(packed)

    def _mtp_normed(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        next_embeddings: list[torch.Tensor],
        mask: torch.Tensor,
        all_real: bool,
        docs: Documents | None,
    ) -> list[torch.Tensor]:
        """Each MTP depth's normed output [s, b, D] (depth k at position t predicts token t + k + 1), from the
        embeddings of each depth's next tokens [s, b, D] when they were looked up with the input (else here)."""
        assert self.mtp is not None
        packed_seq = None if docs is None else docs.packed_seq_params()
        out = []
        for depth, layer in enumerate(self.mtp, start=1):
            assert isinstance(layer, Glm53MtpLayer)
            next_mask = mask & shift_left(mask, depth)
            if docs is not None:
                next_mask = next_mask & docs.same_document(depth, mask.device)[None]
            if next_embeddings:
                emb = next_embeddings[depth - 1]
            else:
                emb = self._embed([shift_left(input_ids, depth)])[0]
            args = (hidden, emb, self._local(next_mask), packed_seq)
            padding = depth if all_real else None
            if self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
                # full recompute covers the MTP layer too (outside megatron's block: recomputed here); it keeps
                # only its inputs, not a whole layer's activations (81 GiB per rank at 128k tokens, released size)
                hidden, normed = checkpoint(
                    layer.predict, *args, trailing_padding=padding, use_reentrant=False
                )
            else:
                hidden, normed = layer.predict(*args, trailing_padding=padding)
            out.append(normed)
        return out

    def mtp_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Logits of each MTP depth k [b, s, V] (position t predicts token t + k + 1)."""
        if self.mtp is None:
            raise ValueError("this model was built without MTP")
        mask, all_real, docs = self._check_inputs(input_ids, attention_mask, None, cu_seqlens)
        hidden = self._hidden(self._embed([input_ids])[0], mask, all_real, docs)
        return [self._logits(n) for n in self._mtp_normed(hidden, input_ids, [], mask, all_real, docs)]

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool, Documents | None]:
        """(the key-padding mask [b, s] bool, whether every token is real, the packed documents) after checking the
        inputs."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if self.sequence is not None and input_ids.shape[1] % self.sequence.size:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} is not divisible by SP = {self.sequence.size} (each SP rank "
                "holds an equal contiguous part of every row; pass the whole rows to every SP rank)"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        # The forward's one host read (docs/numerics.md, host syncs): the token range, whether the mask has padding
        # at all (without, the layers get no mask and skip the padding rules on the host's knowledge) and the
        # packed documents' boundaries.
        all_real, cuts, host = attention_mask is None, None, None
        if input_ids.numel():
            stats = [input_ids.min()[None], input_ids.max()[None]]
            if attention_mask is not None:
                stats.append(attention_mask.bool().all().to(input_ids.dtype)[None])
            if cu_seqlens is not None:
                check_cu_seqlens_type(cu_seqlens)  # before the read; Documents checks the values
                stats.append(cu_seqlens.to(device=input_ids.device, dtype=input_ids.dtype))
            # shape-only (the dry run, meta tensors): no values to check, the shapes are
            host = host_reads.to_list(torch.cat(stats), shape_only=lambda: None)
        if host is not None:
            low, high, masked = host[0], host[1], attention_mask is not None
            if masked:
                all_real = bool(host[2])
            cuts = host[2 + masked :]
            if low < 0 or high >= self.glm.vocab_size:
                raise ValueError(
                    f"input_ids must lie in [0, vocab_size={self.glm.vocab_size}), got range [{low}, {high}]"
                )
        docs = (
            None
            if cu_seqlens is None
            else Documents.from_cu_seqlens(cu_seqlens, input_ids.shape[1], input_ids.shape[0], cuts or None)
        )
        if attention_mask is None:
            return torch.ones_like(input_ids, dtype=torch.bool), True, docs
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        return attention_mask.bool(), all_real, docs


def fp32_kept_names(model: nn.Module) -> list[str]:
    """Names of the parameters transformers keeps in fp32 (the model's `_keep_in_fp32_modules_strict`)."""
    patterns = getattr(model, "_keep_in_fp32_modules_strict", ())
    return [n for n, _ in model.named_parameters() if any(k in n for k in patterns)]


def freeze_padding_row(embedding_weight: nn.Parameter, cfg: Glm53Config) -> None:
    """transformers' `nn.Embedding(padding_idx=pad_token_id)`: the padding token's row gets no gradient.
    Idempotent (a GPTModel's embedding gets it from `load_hf_into`)."""
    pad = cfg.pad_token_id
    if pad is None or not 0 <= pad < cfg.vocab_size or getattr(embedding_weight, "_glm53_padding_row", False):
        return
    # in place: the hook gets the layer's whole gradient on its way to `.grad`, and nothing else reads it; a new
    # tensor would hold the [V, D] gradient twice at the end of every backward (2.4 GiB at the released size)
    embedding_weight.register_hook(lambda g: g.index_fill_(0, torch.full((1,), pad, device=g.device), 0.0))
    embedding_weight._glm53_padding_row = True  # type: ignore[attr-defined]


def shifted_targets(
    labels: torch.Tensor, s: int, shift: int, documents: Documents | None = None
) -> torch.Tensor:
    """[b, s]: the target of position t, labels[:, t + shift], or IGNORE_INDEX (past the labels, or, with packed
    `documents`, in another document than t). `labels` may be longer than s (targets past the input)."""
    b = labels.shape[0]
    target = torch.full((b, s), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    n = min(s, labels.shape[1] - shift)
    if n > 0:
        target[:, :n] = labels[:, shift : shift + n]
    if documents is not None:
        target = target.masked_fill(~documents.same_document(shift, target.device)[None], IGNORE_INDEX)
    return target


def build_model(
    config: Glm53Config | Glm53TransformerConfig,
    dtype: torch.dtype = torch.float32,
    mtp: bool | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    **overrides,
) -> Glm53Model:
    """A randomly initialised model; sets up a world-1 process group and megatron parallel state if needed."""
    ensure_model_parallel()
    tconfig = (
        config
        if isinstance(config, Glm53TransformerConfig)
        else make_transformer_config(config, dtype, **overrides)
    )
    return Glm53Model(tconfig, mtp=mtp, pg_collection=pg_collection)
