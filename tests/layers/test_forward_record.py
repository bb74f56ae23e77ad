"""Losses and expert loads leave the forward as values (glm53_ds/layers/forward_record.py), not module attributes.

Before issue 28 the MoE layers and DSA layers kept `aux_loss`, `last_expert_load`, `indexer_loss` on themselves and
`Glm53Model.forward` found them by scanning `self.modules()`: a value from an earlier forward could be picked up,
and a layer run alone left state behind. Now the model opens a record per forward and hands it out in LossParts.
"""

from __future__ import annotations

import re

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.forward_record import current_record, recording
from glm53_ds.layers.moe import Glm53MoE
from glm53_ds.training.args import build_parser
from glm53_ds.training.config import SetupError
from glm53_ds.training.option_checks import resolve_config
from tests.model_fixtures import CONFIG_A

STALE = ("aux_loss", "last_expert_load", "indexer_loss", "indexer_loss_terms")


def test_the_record_holds_each_forwards_values_and_the_modules_nothing():
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False, moe_seq_aux_loss_coef=0.1, indexer_loss_coef=0.5).train()
    ids = torch.randint(1, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    parts = model(ids, labels=ids, return_parts=True)
    record = parts.record
    moe = [m for m in model.modules() if isinstance(m, Glm53MoE)]
    assert len(record.aux_losses) == len(record.expert_loads) == len(moe)
    assert all(int(load.sum()) == ids.numel() * cfg.num_experts_per_tok for load in record.expert_loads)
    assert torch.allclose(parts.aux, torch.stack(record.aux_losses).sum())
    assert torch.allclose(parts.total, parts.lm + parts.aux + 0.5 * parts.indexer)
    assert not [(n, a) for n, m in model.named_modules() for a in STALE if hasattr(m, a)]
    # a second forward starts a fresh record; none stays open after it
    again = model(ids[:1], labels=ids[:1], return_parts=True).record
    assert again is not record and all(int(x.sum()) == ids[:1].numel() * 2 for x in again.expert_loads)
    assert current_record() is None


def test_a_layer_outside_a_record_keeps_nothing():
    """A module called on its own (or by a stock GPTModel) records nothing and leaves nothing behind."""
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False, moe_seq_aux_loss_coef=0.1).train()
    moe = next(m for m in model.modules() if isinstance(m, Glm53MoE))
    x = torch.randn(6, 2, cfg.hidden_size)
    moe(x)
    assert current_record() is None and not [a for a in STALE if hasattr(moe, a)]
    with recording() as record:
        moe(x)
    assert len(record.aux_losses) == 1 and int(record.expert_loads[0].sum()) == 12 * cfg.num_experts_per_tok


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp", "moe"])


def _grads(model, ids):  # type: ignore[no-untyped-def]
    model(ids, labels=ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_selective_recompute_keeps_the_layer_losses_bitwise():
    """The balance and indexer losses under selective recompute: gradients bitwise those without. A control for
    the record: a layer that computed its loss only while a record is open replays other ops in backward
    (torch's checkpoint refuses: "a different number of tensors was saved")."""
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    ids = torch.randint(1, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = dict(moe_seq_aux_loss_coef=0.1, indexer_loss_coef=0.5)
    torch.manual_seed(0)
    plain = glm53_ds.build_model(cfg, mtp=False, **losses).train()
    recomputed = glm53_ds.build_model(cfg, mtp=False, **losses, **SELECTIVE).train()
    recomputed.load_state_dict(plain.state_dict())
    expected, got = _grads(plain, ids), _grads(recomputed, ids)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--lora-rank", "4"], "LoRA's adapters do not target the indexer"),
        (["--freeze", "indexer"], "--freeze 'indexer' freezes it"),
        (["--trainable", "mlp"], "--trainable 'mlp' leaves it out"),
    ],
)
def test_an_indexer_loss_that_would_train_nothing_is_refused(argv, why):
    """Before: a LoRA run with --indexer-loss-coef computed the loss every step with every indexer tensor frozen
    (the adapters do not target it), and said nothing. Control: with --trainable naming the indexer the same run is
    taken, and its indexer trains (the rule select_trainable applies)."""
    from glm53_ds.training.trainable import INDEXER_TENSORS, trains

    args = ["--indexer-loss-coef", "0.1", "--recompute", "selective", *argv]
    with pytest.raises(
        SetupError, match=rf"--indexer-loss-coef 0.1 trains no indexer tensor \({re.escape(why)}\)"
    ):
        resolve_config(build_parser().parse_args(args))
    if "--freeze" not in argv:
        taken = resolve_config(build_parser().parse_args([*args, "--trainable", r"\.indexer\."]))
        assert all(
            trains(n, taken.lora_rank > 0, taken.trainable, taken.freeze, True) for n in INDEXER_TENSORS
        )


def test_full_recompute_with_layer_losses_is_refused_because_their_gradient_is_lost():
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    with pytest.raises(ValueError, match="recompute_granularity='full' with moe_seq_aux_loss_coef=0.1"):
        glm53_ds.build_model(cfg, mtp=False, moe_seq_aux_loss_coef=0.1, **FULL)
    with pytest.raises(SetupError, match="--recompute full with --indexer-loss-coef 0.5: "):
        resolve_config(build_parser().parse_args(["--recompute", "full", "--indexer-loss-coef", "0.5"]))
    # the reason, measured: the balance loss switched on behind the refusal loses its gradient under full recompute
    ids = torch.randint(1, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = glm53_ds.build_model(cfg, mtp=False, moe_seq_aux_loss_coef=1.0).train()
    full = glm53_ds.build_model(cfg, mtp=False, **FULL).train()
    full.load_state_dict(plain.state_dict())
    for m in full.modules():
        if isinstance(m, Glm53MoE):
            m.seq_aux_loss_coef = 1.0
    expected, got = _grads(plain, ids), _grads(full, ids)
    name = "decoder.layers.2.mlp.router.weight"
    lost = (expected[name] - got[name]).abs().max() / expected[name].abs().max()
    assert lost > 0.5, lost
