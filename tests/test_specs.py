"""GLM-5.3 inside a stock megatron-core `GPTModel` (no subclass, no wrapper): the project's specs + `load_hf_into`.

Tolerances as in tests/test_model.py: fp32 logits max relative error <= 1e-5 (relative to the max |logit|) on
non-padding positions, every parameter's gradient (mapped by name) <= 1e-4 relative to its max magnitude, bf16
logits cosine >= 0.999 against transformers' bf16 logits with HF's attention expression (attention_impl="eager").
megatron's labels are the next tokens (`labels[t] = input_ids[t + 1]`) with a loss mask; transformers' loss over
the same targets is their masked mean.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

import glm53_ds
from glm53_ds import get_glm53_block_spec, get_glm53_mtp_block_spec, load_hf_into, make_transformer_config
from glm53_ds.compat.megatron import GPT_MODEL_NEEDS_MTP_FIELDS
from glm53_ds.config import Glm53Config
from glm53_ds.hf_loader import CheckpointError, gpt_model_names
from glm53_ds.layers.mtp import shift_left
from tests.model_fixtures import (
    CONFIG_A,
    CONFIG_B,
    add_mtp_tensors,
    batch,
    hf_grads_by_native,
    load_hf_reference,
    rel_err,
    save_tiny_hf,
)

CONFIGS = {"A": CONFIG_A, "B": CONFIG_B}
S = 30  # longer than index_topk (8): the DSA selection is sparse


def gpt_model(cfg: Glm53Config, dtype=torch.float32, mtp: bool = False, **kwargs) -> GPTModel:
    """Exactly the snippet of docs/usage.md ("Use in your own Megatron code")."""
    overrides = {
        k: kwargs.pop(k) for k in list(kwargs) if k in ("attention_impl", "pipeline_model_parallel_size")
    }
    tconfig = make_transformer_config(cfg, dtype=dtype, mtp=mtp, **overrides)
    spec = kwargs.pop("spec", None) or get_glm53_block_spec(cfg)
    args = dict(
        vocab_size=cfg.vocab_size,
        max_sequence_length=S,
        position_embedding_type="none",
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        mtp_block_spec=get_glm53_mtp_block_spec(cfg) if mtp else None,
    )
    args.update(kwargs)
    return GPTModel(tconfig, spec, **args)


def positions(b: int, s: int) -> torch.Tensor:
    return torch.arange(s).expand(b, s)


def megatron_targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's (labels, loss_mask) for transformers' causal-LM loss on (ids, mask): target t is token t + 1."""
    labels = shift_left(ids, 1)
    loss_mask = shift_left(mask, 1).float()
    return labels, loss_mask


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"hf_gpt_{request.param}")
    save_tiny_hf(path, CONFIGS[request.param])
    cfg = Glm53Config.from_hf(str(path))
    return path, load_hf_reference(path), load_hf_into(gpt_model(cfg).eval(), str(path))


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_fp32_logits_match_transformers(pair, padding):
    _, hf, gpt = pair
    ids, mask, _ = batch(hf.config.text_config.vocab_size, s=S, padding=padding)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        logits = gpt(ids, positions(*ids.shape), attention_mask=None, padding_mask=~mask)
    assert logits.shape == ref.shape
    assert rel_err(logits[mask], ref[mask]) <= 1e-5


def test_padding_mask_conventions(pair):
    """megatron's [b, 1, s, s] causal mask with padded keys, transformers' [b, s] mask and padding_mask agree;
    an unpadded causal mask equals no mask; a mask KDA cannot apply is refused."""
    _, hf, gpt = pair
    ids, mask, _ = batch(hf.config.text_config.vocab_size, s=S, padding="left")
    pos = positions(*ids.shape)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    megatron_mask = (causal | ~mask[:, None, :])[:, None]  # [b, 1, s, s], True = masked
    with torch.no_grad():
        by_padding = gpt(ids, pos, attention_mask=None, padding_mask=~mask)
        by_megatron = gpt(ids, pos, attention_mask=megatron_mask)
        by_hf = gpt(ids, pos, attention_mask=mask)
        plain = gpt(ids, pos, attention_mask=None)
        plain_causal = gpt(ids, pos, attention_mask=causal[None, None])
    assert torch.equal(by_megatron, by_padding) and torch.equal(by_hf, by_padding)
    assert torch.equal(plain_causal, plain)
    assert rel_err(plain[mask], by_padding[mask]) > 1e-3  # control: the padding changes the logits
    documents = megatron_mask.clone()
    documents[:, :, 20:, 10:20] = True  # a second document from position 20: not causal + padding
    with pytest.raises(ValueError, match="causal attention mask with padded keys"):
        gpt(ids, pos, attention_mask=documents)


def _native_grads(gpt: GPTModel) -> dict[str, torch.Tensor]:
    names = gpt_model_names(gpt)
    params = dict(gpt.named_parameters())
    out = {}
    for native in _native_names(gpt.config.glm):
        for name in names(native):
            if name in params and params[name].grad is not None:
                out[native] = params[name].grad
    return out


def _native_names(cfg: Glm53Config) -> list[str]:
    from glm53_ds.convert.names import released_layout

    return sorted({p.native for ps in released_layout(cfg, mtp=False).values() for p in ps})


@pytest.mark.parametrize("padding", [None, "left"])
def test_fp32_gradients_of_every_parameter(pair, padding):
    _, hf, gpt = pair
    ids, mask, hf_labels = batch(hf.config.text_config.vocab_size, s=S, padding=padding, seed=3)
    labels, loss_mask = megatron_targets(ids, mask)
    hf.zero_grad()
    gpt.zero_grad()
    hf(input_ids=ids, attention_mask=mask.long(), labels=hf_labels).loss.backward()
    per_token = gpt(ids, positions(*ids.shape), attention_mask=None, padding_mask=~mask, labels=labels)
    ((per_token * loss_mask).sum() / loss_mask.sum()).backward()
    ref = hf_grads_by_native(hf, gpt.config.glm)
    got = _native_grads(gpt)
    checked = 0
    for native, pieces in ref.items():
        assert native in got, native
        for index, expected in pieces:
            g = got[native][index] if index else got[native]
            assert rel_err(g, expected) <= 1e-4, f"{native}{index}: {rel_err(g, expected)}"
            checked += 1
    params, names = dict(gpt.named_parameters()), gpt_model_names(gpt)
    frozen = {n for n in _native_names(gpt.config.glm) if n not in ref and any(m in params for m in names(n))}
    assert frozen and all(".indexer." in n for n in frozen)  # HF's indexer runs under no_grad; so does ours
    assert all(params[m].grad is None for n in frozen for m in names(n))
    assert checked > 50


def test_loss_equals_glm53_model_lm_loss(pair):
    path, hf, gpt = pair
    ours = glm53_ds.load_hf(str(path)).eval()
    ids, mask, hf_labels = batch(hf.config.text_config.vocab_size, s=S, padding="right", seed=5)
    labels, loss_mask = megatron_targets(ids, mask)
    with torch.no_grad():
        per_token = gpt(ids, positions(*ids.shape), attention_mask=None, padding_mask=~mask, labels=labels)
        parts = ours(ids, attention_mask=mask, labels=hf_labels, return_parts=True)
    assert per_token.shape == ids.shape
    gpt_loss = (per_token * loss_mask).sum() / loss_mask.sum()
    assert rel_err(gpt_loss, parts.lm) <= 1e-6


def test_bf16_logits_cosine(pair):
    """bf16 GPTModel vs transformers bf16, and bitwise equal to the bf16 Glm53Model.

    Right padding, as test_model_parity: with this batch left-padded, config B measures 0.9966 for both models
    (bitwise equal); the gap is two positions where a DSA pool score near-tie in layer 3 selects other pools in
    bf16 (transformers' bf16 happens to keep fp32's choice there; fp32 parity holds at 1e-5)."""
    path, _, _ = pair
    hf = load_hf_reference(path, dtype=torch.bfloat16)
    cfg = Glm53Config.from_hf(str(path))
    gpt = load_hf_into(gpt_model(cfg, torch.bfloat16, attention_impl="eager").eval(), str(path))
    ours = glm53_ds.load_hf(str(path), dtype=torch.bfloat16, attention_impl="eager").eval()
    for name, p in gpt.named_parameters():  # transformers' fp32-kept tensors stay fp32 in a bf16 GPTModel
        fp32_kept = name.endswith(("_hc.base", "_hc.scale", "A_log", "dt_bias", "conv1d.weight"))
        assert p.dtype == (torch.float32 if fp32_kept else torch.bfloat16), name
    for padding in (None, "right"):
        ids, mask, _ = batch(cfg.vocab_size, s=S, padding=padding)
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask.long()).logits.float()
            logits = gpt(ids, positions(*ids.shape), attention_mask=None, padding_mask=~mask).float()
            assert torch.equal(logits, ours(ids, attention_mask=mask))
        cos = F.cosine_similarity(logits[mask].flatten(), ref[mask].flatten(), dim=0).item()
        assert cos >= 0.999, (padding, cos)


class _StagePG:
    """A pipeline group as megatron's model code reads it (rank / size), for stages run by hand in one process."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _stage(cfg: Glm53Config, rank: int, first_stage_layers: int) -> GPTModel:
    tconfig = make_transformer_config(
        cfg, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=first_stage_layers
    )
    pgs = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
    pgs.pp = _StagePG(rank, 2)
    return GPTModel(
        tconfig, get_glm53_block_spec(tconfig, pp_rank=rank), vocab_size=cfg.vocab_size, max_sequence_length=S,
        pre_process=rank == 0, post_process=rank == 1, position_embedding_type="none",
        share_embeddings_and_output_weights=cfg.tie_word_embeddings, pg_collection=pgs,
    )  # fmt: skip


def test_two_stage_pipeline_equals_one_stage(pair):
    """Stages built from the spec with megatron's layer offset, loaded by load_hf_into (each reads its own layers),
    run in sequence with the packed streams [s*hc_mult, b, h] handed over by hand: same logits as one stage."""
    path, hf, gpt = pair
    cfg = gpt.config.glm
    first = 3  # CONFIG_A: stage 2 starts at a KDA layer; CONFIG_B: at layer 3
    stages = [load_hf_into(_stage(cfg, r, first).eval(), str(path)) for r in (0, 1)]
    assert [len(s.decoder.layers) for s in stages] == [first, cfg.num_hidden_layers - first]
    assert stages[1].decoder.layers[0].layer_number == first + 1
    assert not hasattr(stages[1], "embedding") and stages[0].decoder.final_layernorm is None
    ids, mask, _ = batch(cfg.vocab_size, s=S, padding="left")
    pos = positions(*ids.shape)
    with torch.no_grad():
        handed = stages[0](ids, pos, attention_mask=None, padding_mask=~mask)
        assert handed.shape == (S * cfg.hc_mult, ids.shape[0], cfg.hidden_size)  # megatron's p2p shape, seq*n
        stages[1].set_input_tensor(handed)
        logits = stages[1](None, None, attention_mask=None, padding_mask=~mask)
        whole = gpt(ids, pos, attention_mask=None, padding_mask=~mask)
    assert torch.equal(logits, whole)


def test_pipeline_split_before_a_shared_dsa_layer_is_refused():
    cfg = Glm53Config.from_text_dict(CONFIG_A)  # layer 2 is a 'shared' DSA layer
    tconfig = make_transformer_config(
        cfg, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2
    )
    with pytest.raises(ValueError, match="starts at layer 2 .*'shared' DSA layer"):
        get_glm53_block_spec(tconfig, pp_rank=1)
    assert len(get_glm53_block_spec(tconfig, pp_rank=0).layer_specs) == 2  # the first stage is fine


def test_load_hf_into_refuses_a_gpt_model_it_cannot_fill(pair):
    path, _, gpt = pair
    cfg = gpt.config.glm
    with pytest.raises(CheckpointError, match="position_embedding_type='learned_absolute'"):
        load_hf_into(gpt_model(cfg, position_embedding_type="learned_absolute"), str(path))
    with pytest.raises(
        CheckpointError, match=f"vocab_size={cfg.vocab_size + 1} does not match .*{cfg.vocab_size}"
    ):
        load_hf_into(gpt_model(cfg, vocab_size=cfg.vocab_size + 1), str(path))
    other = cfg.replace(num_hidden_layers=cfg.num_hidden_layers - 1, layer_types=cfg.layer_types[:-1],
                        mlp_layer_types=cfg.mlp_layer_types[:-1], indexer_types=cfg.indexer_types[:-1])  # fmt: skip
    with pytest.raises(CheckpointError, match="num_hidden_layers: model"):
        load_hf_into(gpt_model(other), str(path))
    with pytest.raises(TypeError, match="Glm53Model or a megatron GPTModel"):
        load_hf_into(torch.nn.Linear(2, 2), str(path))


def test_mtp_through_megatrons_block(tmp_path):
    """GPTModel(mtp_block_spec=...) runs the GLM MTP layer in megatron's MultiTokenPredictionBlock, loaded from the
    released MTP tensors. Its output is docs/mtp.md's equation with one input changed, the measured difference
    documented in docs/usage.md: h is the decoder output after the final norm (megatron's wiring)."""
    save_tiny_hf(tmp_path, CONFIG_A)
    add_mtp_tensors(tmp_path)
    cfg = Glm53Config.from_hf(str(tmp_path))
    # the snippet as written: a config without mtp=True takes megatron's MTP fields from the spec's layer
    # where megatron builds the block first (0.16.1); later releases decide from the config before building
    # (compat/megatron.py), so there the config needs mtp=True
    plain_config = make_transformer_config(cfg, mtp=GPT_MODEL_NEEDS_MTP_FIELDS)
    plain = GPTModel(plain_config, get_glm53_block_spec(cfg), cfg.vocab_size, S,
                     position_embedding_type="none", mtp_block_spec=get_glm53_mtp_block_spec(cfg))  # fmt: skip
    assert plain.config.mtp_num_layers == 1 and plain.config.mtp_loss_scaling_factor == cfg.mtp_loss_weight
    # a config naming other MTP depths than the spec: refused by our layer's message where megatron builds the
    # layer first (0.16.1); later releases' own block refuses it first, in its words
    with pytest.raises(ValueError, match="" if GPT_MODEL_NEEDS_MTP_FIELDS else "mtp=True"):
        GPTModel(make_transformer_config(cfg, mtp_num_layers=2), get_glm53_block_spec(cfg), cfg.vocab_size, S,
                 position_embedding_type="none", mtp_block_spec=get_glm53_mtp_block_spec(cfg))  # fmt: skip
    gpt = load_hf_into(gpt_model(cfg, mtp=True).eval(), str(tmp_path))
    plain_gpt = load_hf_into(plain.eval(), str(tmp_path))
    ours = glm53_ds.load_hf(str(tmp_path), mtp=True).eval()
    ids, mask, _ = batch(cfg.vocab_size, s=S, padding="right")
    pos = positions(*ids.shape)
    with torch.no_grad():
        decoder_out = gpt.decoder(gpt.embedding(ids, pos), attention_mask=None, padding_mask=~mask)
        mtp_out = gpt.mtp(ids, pos, decoder_out, attention_mask=mask, embedding=gpt.embedding)
        megatron_normed = mtp_out.chunk(2, dim=0)[1]
        # docs/mtp.md's layer, fed what megatron feeds it
        embedded, emb = ours._embed([ids, shift_left(ids, 1)])
        hidden = ours._hidden(embedded, mask, False, None)
        m2 = mask & shift_left(mask, 1)
        _, fed_normed = ours.mtp[0].predict(ours.final_norm.normalize(hidden), emb, m2)
        _, reference = ours.mtp[0].predict(hidden, emb, m2)
    valid = m2.transpose(0, 1)
    assert rel_err(megatron_normed[valid], fed_normed[valid]) <= 1e-5
    assert rel_err(megatron_normed[valid], reference[valid]) > 1e-2  # the wiring difference is real
    with torch.no_grad():
        labels, loss_mask = megatron_targets(ids, mask)
        args = (ids, pos)
        kwargs = dict(attention_mask=mask, labels=labels, loss_mask=loss_mask)
        assert torch.equal(plain_gpt(*args, **kwargs), gpt(*args, **kwargs))
    # megatron returns the LM per-token loss and adds the MTP loss to the gradient (MTPLossAutoScaler). Eval mode:
    # in train mode megatron 0.16.1 logs the MTP loss into a CUDA tensor, which a CPU run cannot allocate.
    labels, loss_mask = megatron_targets(ids, mask)
    per_token = gpt(ids, pos, attention_mask=mask, labels=labels, loss_mask=loss_mask)
    (per_token * loss_mask).sum().div(loss_mask.sum()).backward()
    eh = gpt.mtp.layers[0].eh_proj.weight.grad
    assert eh is not None and eh.abs().sum() > 0
