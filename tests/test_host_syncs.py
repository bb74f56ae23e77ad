"""The host-sync budget (glm53_ds/host_syncs.py), held on CPU by counting the ops that would block a GPU's launch
queue, over one forward + backward of a tiny model with every module kind: KDA, DSA (full and shared indexers),
dense and MoE FFNs, one MTP depth.

Budget (EP = 1): one host read per forward, the input check in `Glm53Model._check_inputs` (token range, whether
the mask has padding, the packed documents' boundaries: one `tolist`), and none in any layer or in backward, on
batches without padding, packed or not. A batch with padding adds one per full DSA layer (which k-pools HF keeps
is decided on the device); a packed row adds one per DSA layer where blind rows are possible (padding, as in an MTP
depth, or no tail selection), in its forward and in backward (each blind query averages its own document). Under EP each MoE layer adds one copy of its all-to-all split sizes
(tests/engine/test_gradient_sync.py). Controls: the counter sees every kind of sync it names, and the reference loop
experts (`moe_impl="loop"`) break the budget.
"""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.host_syncs import HostSyncCounter
from tests.model_fixtures import CONFIG_A

SEQ = 32


def test_counter_sees_every_sync_kind_and_nothing_else():
    x = torch.randn(6)
    mask = x > 0
    counts = torch.tensor([1, 2, 3])
    with HostSyncCounter() as counter:
        y = (x * 2).exp().sum(0)  # no sync
        torch.repeat_interleave(torch.arange(3), counts, output_size=6)  # no sync: the size is given
        assert counter.total_syncs == 0
        x.sum().item()  # _local_scalar_dense
        bool(mask.any())  # _local_scalar_dense
        x[mask]  # boolean indexing
        torch.where(mask)  # nonzero
        torch.unique(x)  # _unique2
        torch.masked_select(x, mask)
        torch.bincount(counts)
        torch.repeat_interleave(torch.arange(3), counts)  # no output_size
        x.tolist()
        torch.tensor([1.0, 2.0])  # host data
    assert counter.total_syncs == 10, counter.report()
    assert y.numel() == 1


def _model(**fields):  # type: ignore[no-untyped-def]
    cfg = Glm53Config.from_text_dict(dict(CONFIG_A, num_nextn_predict_layers=1, **fields))
    torch.manual_seed(0)
    model = glm53_ds.build_model(cfg, mtp=True)
    return model.train(), cfg


def _step(model, cfg, kind: str) -> HostSyncCounter:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (2, SEQ), generator=g)
    kwargs = {}
    if kind == "packed":
        ids, kwargs = ids[:1], {"cu_seqlens": torch.tensor([0, 10, 25, SEQ])}
    if kind == "padded":
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, :5] = False
        kwargs = {"attention_mask": mask}
    with HostSyncCounter(model) as counter:
        model(ids, labels=ids, **kwargs).backward()
    return counter


def _full_dsa_layers(model) -> int:  # type: ignore[no-untyped-def]
    layers = list(model.decoder.layers) + [m.transformer_layer for m in model.mtp]
    return sum(getattr(layer.self_attention, "indexer", None) is not None for layer in layers)


@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_one_host_read_per_forward_none_in_layers(kind):
    model, cfg = _model()
    counter = _step(model, cfg, kind)
    layers = counter.layer_scopes()
    assert len(layers) == cfg.num_hidden_layers + 1  # every decoder layer and the MTP depth ran in a scope
    # packed: the MTP depth's padding (each document's last position) makes blind rows possible, which average
    # their own document's values: one read of the boundaries in its forward and one in backward
    blind = {"mtp1": 1} if kind == "packed" else {}
    assert all(s.syncs == blind.get(name, 0) for name, s in layers.items()), counter.report()
    assert counter.scopes["backward"].syncs == len(blind), counter.report()
    assert counter.total_syncs == 1 + 2 * len(blind), counter.report()
    (site,) = counter.scopes["outside"].sync_sites
    assert site.startswith("tolist @ model.py"), site
    for name in [*blind, "backward"] if blind else []:
        assert all(s.startswith("tolist @ layers/blind_rows.py") for s in counter.scopes[name].sync_sites)


def test_padded_batch_budget():
    model, cfg = _model()
    counter = _step(model, cfg, "padded")
    assert counter.scopes["backward"].syncs == 0, counter.report()
    assert counter.total_syncs == 1 + _full_dsa_layers(model), counter.report()


def test_tail_free_selection_keeps_the_budget():
    """Without tail selection the first kpool - 1 queries of a document see nothing (blind rows): HF's value and
    gradient there come in closed form, with no host sync."""
    model, cfg = _model(index_kpool_always_select_tail=False)
    counter = _step(model, cfg, "unpacked")
    assert counter.total_syncs == 1, counter.report()


def test_control_loop_experts_break_the_budget_and_cost_more_ops():
    """The reference loop (today's experts before grouped GEMMs): a nonzero per local expert and a split by host
    counts; also more aten ops per MoE layer (a proxy for kernel launches)."""
    model, cfg = _model()
    grouped = _step(model, cfg, "unpacked")
    for module in model.modules():
        if hasattr(module, "moe_impl"):
            module.moe_impl = "loop"
    loop = _step(model, cfg, "unpacked")
    moe = [f"layer{i}" for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    assert all(loop.scopes[name].syncs >= cfg.n_routed_experts for name in moe), loop.report()
    assert loop.total_syncs > grouped.total_syncs + len(moe) * cfg.n_routed_experts - 1
    assert all(loop.scopes[name].ops > grouped.scopes[name].ops for name in moe)
