"""Optimizer semantics (issue 13): the DSA indexer is frozen for the LM loss or trained by its own KL loss, and weight
decay spares biases and 1-D parameters. The KL loss is checked against an independent per-query reference."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.engine.build import decays, optimizer_param_groups, prepare_model
from glm53_ds.layers.dsa_indexer import DsaIndexer, kl_from_scores
from glm53_ds.layers.mla import SparseMLA
from glm53_ds.layers.sparse_attention import pooled_attention_mass
from glm53_ds.parallel import init_layout
from tests.cli import deepspeed_run, tiny_hf_checkpoint
from tests.model_fixtures import CONFIG_A, rel_err

ONE_D = ("A_log", "dt_bias", "_hc.base", "_hc.scale", "norm.weight", "layernorm.weight")


def _is_indexer(name: str) -> bool:
    return ".indexer." in name


# ----------------------------------------------------------------------------- weight-decay groups
def group_problems(model: torch.nn.Module, groups: list[dict], weight_decay: float) -> list[str]:
    """What is wrong with `groups`: a bias / 1-D parameter decayed, a matrix not decayed, a frozen one present."""
    names = {id(p): n for n, p in model.named_parameters()}
    problems, seen = [], set()
    for group in groups:
        wd = group.get("weight_decay", weight_decay)
        for p in group["params"]:
            name = names[id(p)]
            seen.add(name)
            if (p.dim() < 2 or name.endswith(".bias")) and wd != 0:
                problems.append(f"{name} decays")
            if p.dim() >= 2 and not name.endswith(".bias") and wd != weight_decay:
                problems.append(f"{name} does not decay")
            if not p.requires_grad:
                problems.append(f"{name} is frozen but optimized")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in seen]
    return problems + [f"{n} is not optimized" for n in missing]


def test_weight_decay_spares_biases_and_1d_parameters():
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A))
    prepare_model(model, init_layout(1, 1))
    groups = optimizer_param_groups(model)
    optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    assert group_problems(model, optimizer.param_groups, 0.1) == []
    no_decay = {n for n, p in model.named_parameters() if p.requires_grad and not decays(n, p)}
    for kind in ONE_D:
        assert any(kind in n for n in no_decay), kind
    assert any("experts.gate_up_proj" in n for n, p in model.named_parameters() if decays(n, p))
    # every indexer tensor is frozen and in no group
    indexer = [n for n, p in model.named_parameters() if _is_indexer(n)]
    assert len(indexer) >= 7 and all(
        not p.requires_grad for n, p in model.named_parameters() if _is_indexer(n)
    )
    # the pattern exempts more names
    extra = optimizer_param_groups(model, no_decay_pattern=r"\.q_a_proj\.")
    decayed = {id(p) for g in extra if "weight_decay" not in g for p in g["params"]}
    assert not any(id(p) in decayed for n, p in model.named_parameters() if ".q_a_proj." in n)
    # control: the old single group (every trainable parameter at the same weight decay) is caught
    old = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": 0.1}]
    assert any("A_log decays" in problem for problem in group_problems(model, old, 0.1))


# ----------------------------------------------------------------------------- the KL loss
def _case(seed: int = 0, rows_per_block: int | None = None):
    """An indexer's pools and streamed selection on random inputs, with sparse selection active (s > index_topk),
    and random absorbed queries / latents for the main attention (q_lat [b, s, h, R], latent [b, s, R])."""
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    tconfig = glm53_ds.make_transformer_config(cfg, indexer_loss_coef=1.0)
    torch.manual_seed(seed)
    indexer = DsaIndexer(tconfig)
    with torch.no_grad():
        for p in indexer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    b, s, heads, rank = 2, 23, 3, 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, cfg.hidden_size, generator=g)
    q_resid = torch.randn(b, s, cfg.q_lora_rank, generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, :3] = False  # left padding in the second row
    if rows_per_block is not None:  # stream the scores over blocks of this many query rows
        indexer.score_block_bytes = 1
        indexer.block_rows = lambda *args: rows_per_block
    pools = indexer.pools(indexer.keys(x), mask)
    selection = indexer.select(x, q_resid, mask, pools)
    q_lat, latent = torch.randn(b, s, heads, rank, generator=g), torch.randn(b, s, rank, generator=g)
    scaling = rank**-0.5
    target = pooled_attention_mass(
        q_lat, latent, selection.tokens, selection.pools.shape[-1], indexer.kpool, scaling
    )
    return indexer, x, q_resid, mask, pools, selection, q_lat, latent, target, scaling


def reference_kl(scores, selection, pool_tokens, q_lat, latent, scaling):
    """Per query, in float64, written out: the head-summed attention over the selected keys, pooled, normalised over
    the selected pools; KL to the softmax of the index scores over the same pools; mean over queries with a target.
    scores [b, s, P] of every pool."""
    b, s, heads, _ = q_lat.shape
    losses = []
    for i in range(b):
        for t in range(s):
            pools = selection.pools[i, t][selection.pools_ok[i, t]].tolist()
            keys = [j for j in selection.tokens[i, t].tolist() if j >= 0]
            if not pools or not keys:
                continue
            attention = torch.zeros(s, dtype=torch.float64)
            for h in range(heads):
                logits = torch.stack(
                    [q_lat[i, t, h].double() @ latent[i, j].double() * scaling for j in keys]
                )
                attention[keys] += torch.softmax(logits, 0)
            mass = torch.stack(
                [sum(attention[j] for j in pool_tokens[i, P].tolist() if j >= 0) for P in pools]
            )
            if mass.sum() <= 0:
                continue
            p = mass / mass.sum()
            log_r = torch.log_softmax(scores[i, t, pools].double(), 0)
            losses.append(
                sum(pk * (math.log(pk) - lr) for pk, lr in zip(p.tolist(), log_r, strict=True) if pk > 0)
            )
    return torch.stack(losses).mean()


def test_kl_loss_and_gradient_match_the_reference():
    indexer, x, q_resid, mask, pools, selection, q_lat, latent, target, scaling = _case()
    candidates = indexer.candidates(pools, torch.arange(x.shape[1]))
    assert selection.pools_ok.sum(-1).max() < candidates.sum(-1).max()  # sparse: some candidates not selected
    with torch.no_grad():
        scores = indexer.scores(x, q_resid, pools.keys).requires_grad_(True)  # [b, s, P]
    total, count = kl_from_scores(scores.gather(-1, selection.pools), selection.pools_ok, target)
    loss = total / count
    (grad,) = torch.autograd.grad(loss, scores)
    ref_scores = scores.detach().double().requires_grad_(True)
    ref = reference_kl(ref_scores, selection, pools.tokens, q_lat, latent, scaling)
    (ref_grad,) = torch.autograd.grad(ref, ref_scores)
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item()), (loss.item(), ref.item())
    assert rel_err(grad.double(), ref_grad) <= 1e-6
    assert loss.item() > 1e-3


def test_streamed_kl_terms_equal_the_whole_sequence_ones():
    """`kl_terms` one query row per block (a 1-byte block budget; the selection streamed over blocks of 4): the same
    loss and indexer parameter gradients as the unstreamed expression on the whole [b, s, P] scores, within fp32
    rounding."""
    indexer, x, q_resid, mask, pools, selection, q_lat, latent, target, scaling = _case(rows_per_block=4)
    whole = _case()
    assert torch.equal(selection.tokens, whole[5].tokens) and torch.equal(
        selection.pools_ok, whole[5].pools_ok
    )
    assert indexer.block_bytes(x.device) == 1
    total, count = indexer.kl_terms(x, q_resid, pools, selection, target)
    grads = torch.autograd.grad(total / count, list(indexer.parameters()))
    pools2 = indexer.pools(indexer.keys(x), mask)
    scores = indexer.scores(x, q_resid, pools2.keys).gather(-1, selection.pools)
    total2, count2 = kl_from_scores(scores, selection.pools_ok, target)
    grads2 = torch.autograd.grad(total2 / count2, list(indexer.parameters()))
    assert count.item() == count2.item() > 0
    assert abs(total.item() - total2.item()) <= 1e-6 * abs(total2.item())
    for g1, g2 in zip(grads, grads2, strict=True):
        assert rel_err(g1, g2) <= 1e-5


def test_kl_loss_is_zero_when_the_indexer_reproduces_the_attention():
    indexer, x, q_resid, mask, pools, selection, q_lat, latent, target, scaling = _case(seed=1)
    # the target distribution from the reference's own pooling: index scores = its log (softmax is shift-free)
    b, s = mask.shape
    scores = torch.full(selection.pools.shape, -30.0)
    for i in range(b):
        for t in range(s):
            ok = selection.pools_ok[i, t]
            keys = [j for j in selection.tokens[i, t].tolist() if j >= 0]
            if not ok.any() or not keys:
                continue
            attention = torch.zeros(s, dtype=torch.float64)
            for h in range(q_lat.shape[2]):
                attention[keys] += torch.softmax(
                    (latent[i, keys].double() @ q_lat[i, t, h].double()) * scaling, 0
                )
            mass = torch.stack(
                [
                    attention[[j for j in pools.tokens[i, P].tolist() if j >= 0]].sum()
                    for P in selection.pools[i, t]
                ]
            )
            scores[i, t] = torch.where(
                ok, torch.log(mass.clamp_min(1e-30) / mass[ok].sum()).float() + 5.0, -30.0
            )
    total, count = kl_from_scores(scores, selection.pools_ok, target)
    assert count.item() > 0 and (total / count).item() <= 1e-6
    # control: the scores of another seed's indexer do not reproduce it
    wrong, _ = kl_from_scores(
        torch.randn(scores.shape, generator=torch.Generator().manual_seed(5)), selection.pools_ok, target
    )
    assert (wrong / count).item() > 1e-2


def test_the_indexer_loss_target_runs_in_the_indexers_blocks(monkeypatch):
    """The target (the main attention's mass on the chosen pools) is computed in blocks of the indexer's budget
    (1 GiB on a GPU), not the torch reference's 4 MiB: at the released width those held one query, a loop of one
    iteration per query (16,384 per layer per rank at 128k / SP 8, found by the dry run). Here the indexer's budget
    is cut to one query row: 24 blocks per full-indexer layer, the same loss as one block. Control: with the
    reference's budget the target took one block per layer whatever the indexer's."""
    from glm53_ds.layers import mla, sparse_attention

    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False, indexer_loss_coef=0.5).train()
    ids = torch.randint(1, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    rows: list[int] = []  # query rows of each block of the target (the attention's own calls not counted)
    in_target = []
    probabilities, target = sparse_attention.slot_probabilities, mla.pooled_attention_mass

    def counted(q_lat, *rest):  # type: ignore[no-untyped-def]
        if in_target:
            rows.append(q_lat.shape[1])
        return probabilities(q_lat, *rest)

    def marked(*args, **kwargs):  # type: ignore[no-untyped-def]
        in_target.append(True)
        try:
            return target(*args, **kwargs)
        finally:
            in_target.clear()

    monkeypatch.setattr(sparse_attention, "slot_probabilities", counted)
    monkeypatch.setattr(mla, "pooled_attention_mass", marked)
    whole = model(ids, labels=ids, return_parts=True).indexer
    layers = [m.indexer for m in model.modules() if isinstance(m, SparseMLA) and m.indexer is not None]
    assert layers and rows == [24] * len(layers)
    for indexer in layers:
        indexer.score_block_bytes = 1  # one query row per block
    rows.clear()
    blocked = model(ids, labels=ids, return_parts=True).indexer
    assert rows == [1] * 24 * len(layers)
    # the same loss up to fp32 summation order: the KL is a small sum of differences (1e-5 here), and one thread
    # or two sum it differently (3e-4 relative seen under OMP_NUM_THREADS=1)
    assert torch.allclose(blocked, whole, rtol=1e-3, atol=0)


def test_indexer_loss_trains_only_the_indexer():
    """One step with and without the coefficient: the LM-loss gradients of every other parameter are bitwise the
    same (the indexer reads detached inputs), the indexer gets gradients only from its loss."""
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    frozen = glm53_ds.build_model(cfg, mtp=False).train()
    trained = glm53_ds.build_model(cfg, mtp=False, indexer_loss_coef=0.5).train()
    trained.load_state_dict(frozen.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    frozen(ids, labels=ids).backward()
    parts = trained(ids, labels=ids, return_parts=True)
    parts.total.backward()
    assert parts.indexer is not None and parts.indexer.item() > 0
    assert torch.allclose(parts.total, parts.lm + 0.5 * parts.indexer)
    grads = dict(frozen.named_parameters())
    for name, p in trained.named_parameters():
        if _is_indexer(name):
            assert grads[name].grad is None and not grads[name].requires_grad
            assert p.grad is not None
            continue
        assert torch.equal(p.grad, grads[name].grad), name
    assert any(p.grad.abs().sum() > 0 for n, p in trained.named_parameters() if _is_indexer(n))
    full = [m for m in trained.modules() if isinstance(m, SparseMLA) and m.indexer is not None]
    assert len(full) < sum(
        isinstance(m, SparseMLA) for m in trained.modules()
    )  # there are `shared` layers too
    assert len(parts.record.indexer_losses) == len(
        full
    )  # one loss per full indexer; `shared` layers add nothing
    assert torch.allclose(parts.indexer, torch.stack(parts.record.indexer_losses).sum())


@pytest.mark.slow
def test_indexer_frozen_by_default_and_trained_with_its_loss_under_ep2(tmp_path):
    """From a released-layout directory, 2 ranks EP2 at high lr and weight decay: every indexer tensor is bitwise the
    source's in --export-hf, attention projections move; with --indexer-loss-coef the indexer moves too. (Before:
    weight decay shrank 5 of the 7 indexer tensors of a tiny model in 5 steps.)"""
    source = tmp_path / "hf"
    source.mkdir()
    tiny_hf_checkpoint(source)
    original = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(f).items()}
    indexer_names = [k for k in original if ".indexer." in k]
    assert len(indexer_names) >= 7
    for coef in ("0", "1.0"):
        out = tmp_path / f"export{coef}"
        proc = deepspeed_run(2, "--hf-dir", str(source), "--tokenizer", "bytes", "--ep", "2", "--train-iters", "3",
                             "--lr", "1e-2", "--weight-decay", "0.1", "--warmup", "0", "--indexer-loss-coef", coef,
                             "--output-dir", str(tmp_path / f"run{coef}"), "--export-hf", str(out))  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
        unchanged = [n for n in indexer_names if torch.equal(exported[n], original[n])]
        moved = [n for n in original if "q_a_proj" in n and not torch.equal(exported[n], original[n])]
        assert moved, "attention projections did not train"
        if coef == "0":
            assert unchanged == indexer_names
        else:
            assert len(unchanged) < len(indexer_names) // 2, unchanged
            with open(tmp_path / f"run{coef}" / "metrics.jsonl", encoding="utf-8") as f:
                assert all(json.loads(line)["indexer_loss"] > 0 for line in f)
    assert os.path.isdir(tmp_path / "export0")
