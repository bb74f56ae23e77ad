"""`--compile` (glm53_ds/compile.py): every region compiles without a graph break, packed documents of changing
counts and lengths compile once, and the compiled model's losses and gradients are eager's.

The regions are traced with the "aot_eager" backend: dynamo and AOT autograd build the same forward and backward
graphs inductor would get, without generating code (inductor on the CPU takes about 5 minutes for the tiny model;
benchmarks/model_step.py measures it)."""

from __future__ import annotations

import json

import pytest
import torch

import glm53_ds
import glm53_ds.compile
from glm53_ds.compile import apply_compile, compiled_regions
from glm53_ds.config import Glm53Config
from glm53_ds.layers.moe import Glm53MoE
from glm53_ds.training.presets import tiny
from tests.cli import deepspeed_run, metrics
from tests.model_fixtures import CONFIG_A

# every layer kind: KDA and DSA (a full and a shared indexer), dense and MoE, the first layer, MTP; the balance loss
# and the indexer's KL loss leave the regions through the forward record
KINDS = dict(moe_seq_aux_loss_coef=0.1, indexer_loss_coef=0.5)
# mHC's Sinkhorn loop is the same code at any count, unrolled into every region's graph: 2 iterations instead of
# the released 20 make the graphs a third smaller and the trace a third faster (CONFIG_A's whole rows in fp32:
# 109 -> 75 s on a 2-core machine)
TEXT = dict(CONFIG_A, hc_sinkhorn_iters=2)
# each attention kind (KDA, DSA with a full and a shared indexer) and each MLP kind (dense, MoE) once, the first
# layer and MTP: every region's code in 3 layers (CONFIG_A's 6 hold 5 kinds of layer)
EACH_KIND_ONCE = dict(TEXT, num_hidden_layers=3, layer_types=["linear_attention", "indexed_attention",
                      "indexed_attention"], indexer_types=["full", "full", "shared"],
                      mlp_layer_types=["dense", "sparse", "sparse"])  # fmt: skip


def _model(
    dtype: torch.dtype, text: dict | None = None, **kw
) -> tuple[torch.nn.Module, torch.nn.Module, Glm53Config]:
    """Two equal models of `text` (TEXT): one to run eager, one to compile."""
    cfg = Glm53Config.from_text_dict(TEXT if text is None else text)
    torch.manual_seed(0)
    eager = glm53_ds.build_model(cfg, dtype=dtype, **KINDS, **kw).train()
    compiled = glm53_ds.build_model(cfg, dtype=dtype, **KINDS, **kw).train()
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled, cfg


def _packed_rows(
    eager, compiled, vocab: int, gen: torch.Generator, steps: int, n_cuts, checked: int
) -> list[int]:
    """`steps` packed rows of 32 tokens, row i cut at `n_cuts(i, gen)` random places, each through the compiled
    model (the first `checked` also through eager: losses and gradients within 1e-5); dynamo's count of unique
    graphs after each row."""
    length, graphs = 32, []
    for step in range(steps):
        cuts = sorted(torch.randperm(length - 1, generator=gen)[: n_cuts(step, gen)].add(1).tolist())
        cu_seqlens = torch.tensor([0, *cuts, length])
        ids = torch.randint(1, vocab, (1, length), generator=gen)
        compiled_step = _step(compiled, ids, cu_seqlens=cu_seqlens)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if step < checked:
            _assert_equal_within(_step(eager, ids, cu_seqlens=cu_seqlens), compiled_step, 1e-5)
    return graphs


def _step(
    model: torch.nn.Module, ids: torch.Tensor, **kw
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    parts = model(ids, labels=ids, return_parts=True, **kw)
    parts.total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # every loss the model reports (a model without DSA layers has no indexer loss, without MTP no MTP loss)
    losses = {k: t.detach() for k, t in vars(parts).items() if isinstance(t, torch.Tensor) and t.dim() == 0}
    return losses, grads


# the indexer's KL loss (about 2e-5 here) is the difference of a cross entropy and an entropy, each of order 1
CANCELLING_LOSSES = ("indexer",)


def _assert_equal_within(a, b, rel: float) -> None:
    """Losses within `rel`, each gradient within 10 `rel` of its largest magnitude (at 1e-5 the model tests' fp32
    bounds against transformers, tests/test_model.py), an mHC `base` / `scale` gradient and the indexer's KL loss
    within 100 `rel`: each is a sum of terms of both signs, so the order of the sum shows (measured with packed
    documents, whose layers run in two graphs each: up to 1.25e-4, every other gradient 6e-6; with mHC's write-back
    traced as torch code, the KL 1.5e-4)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert loss_a.keys() == loss_b.keys() and {"total", "lm"} <= loss_a.keys(), (loss_a, loss_b)
    for name, value in loss_a.items():
        bound = (100 if name in CANCELLING_LOSSES else 1) * rel
        assert torch.allclose(value, loss_b[name], rtol=bound, atol=0), (name, value, loss_b[name])
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        err = (g.float() - grads_b[name].float()).abs().max() / g.float().abs().max().clamp_min(1e-30)
        cancelling = name.endswith(("_hc.base", "_hc.scale"))
        assert err <= (100 if cancelling else 10) * rel, (name, float(err))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, text", [(torch.float32, TEXT), (torch.bfloat16, EACH_KIND_ONCE)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_every_region_compiles_whole_and_matches_eager(dtype, text):
    """fp32: every kind of layer of CONFIG_A; bf16: each attention and MLP kind once (what bf16 changes is each
    module's dtypes: its fp32-kept parameters, its casts, the grouped GEMM's bf16 form)."""
    eager, compiled, cfg = _model(dtype, text)
    names = apply_compile(compiled, backend="aot_eager", fullgraph=True)  # a graph break would raise
    assert names == compiled_regions(compiled)
    assert names == [f"decoder.layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp.0", "loss_head"]
    ids = torch.randint(1, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    # aot_eager runs the ops eager runs, but mHC's write-back is torch code in a region (the op's chunks eager), summed
    # in another order. bf16: within one bf16 rounding, 2^-8 (measured: gradients 1.03e-2 <= 10 x, mHC's 0.10 <= 100
    # x; fp32: the KL 1.5e-4, gradients 1.4e-5, mHC's 3e-5)
    _assert_equal_within(_step(eager, ids), _step(compiled, ids), 1e-5 if dtype == torch.float32 else 2**-8)
    assert compiled_regions(eager) == []


def _traced_graphs(model: torch.nn.Module, vocab: int) -> list[tuple[bool, set[str]]]:
    """Compile `model`'s regions with a backend that records, for each graph dynamo hands it, whether any input has a
    symbolic size and the ops it calls, and runs the graph as traced; one step of 2 rows of 24 tokens."""
    graphs = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        sizes = [s for v in values for s in (v.shape if isinstance(v, torch.Tensor) else (v,))]
        ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        graphs.append((any(isinstance(s, torch.SymInt) for s in sizes), ops))
        return gm.forward

    torch._dynamo.reset()
    apply_compile(model, backend=recording)
    ids = torch.randint(1, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids)
    return graphs


@pytest.mark.slow
def test_every_region_is_traced_with_static_shapes_and_mhc_as_torch_code(monkeypatch):
    """The first layer takes the embedding, every other the 4x longer packed streams: under torch.compile's default
    the second layer would be traced with a symbolic length (dynamo's automatic dynamic) and every later one with it
    (3.4x the fp32 trace above). `compile.DYNAMIC = False` keeps every graph static. The control: torch's default
    gives symbolic graphs, which this check sees. On the CPU, mHC's write-back enters the graphs as torch code
    (`hc_post_traced`), not as its op's opaque eager chunks."""
    _, compiled, cfg = _model(torch.float32, EACH_KIND_ONCE)
    graphs = _traced_graphs(compiled, cfg.vocab_size)
    assert len(graphs) == 5 and not any(symbolic for symbolic, _ in graphs), graphs  # 3 layers, MTP, the head
    assert not any("hc_post" in op for _, ops in graphs for op in ops)
    # the recording sees ops: DSA's attention is its opaque op
    assert any("sparse_attention_reference" in op for _, ops in graphs for op in ops)
    monkeypatch.setattr(glm53_ds.compile, "DYNAMIC", None)
    _, default, _ = _model(torch.float32, EACH_KIND_ONCE)
    assert any(symbolic for symbolic, _ in _traced_graphs(default, cfg.vocab_size))
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_graph_break_in_a_layer_is_caught(monkeypatch):
    """The control: a region with a graph break fails the whole-graph trace above."""
    _, compiled, cfg = _model(torch.float32, EACH_KIND_ONCE)
    tile_tokens = Glm53MoE.tile_tokens

    def breaking(self):
        torch._dynamo.graph_break()
        return tile_tokens(self)

    monkeypatch.setattr(Glm53MoE, "tile_tokens", breaking)
    apply_compile(compiled, backend="aot_eager", fullgraph=True)
    ids = torch.randint(1, cfg.vocab_size, (1, 16))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(ids, labels=ids)


@pytest.mark.slow
def test_packed_documents_of_changing_counts_and_lengths_are_one_graph_compiled_once():
    """Packed documents reach the layers as tensors whose shapes do not depend on the packing (each token's document
    and position): every region of the model (KDA, DSA with a full and a shared indexer and its KL loss, dense and
    MoE, MTP with its padded documents) traces whole (`fullgraph=True`) over 20 packed rows of 1 to 6 documents,
    compiles at the first step and not again, and every checked step's losses and gradients are eager's. The
    control: the dense parity path's loop over the documents (`mla._dense_over_documents`) fails the same trace."""
    eager, compiled, cfg = _model(torch.float32)
    torch._dynamo.reset()  # no cache entry of an earlier test's layers (their graphs are keyed by the code object)
    apply_compile(compiled, backend="aot_eager", fullgraph=True)  # a graph break would raise
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(2)
    graphs = _packed_rows(eager, compiled, cfg.vocab_size, gen, 20,
                          lambda step, gen: int(torch.randint(0, 6, (1,), generator=gen)), checked=3)  # fmt: skip
    assert graphs[-1] == graphs[0], graphs
    assert not torch._dynamo.utils.counters["graph_break"]
    # the control: a per-document loop leaves the graph
    _, dense, _ = _model(torch.float32, attention_impl="dense")
    torch._dynamo.reset()
    apply_compile(dense, backend="aot_eager", fullgraph=True)
    ids = torch.randint(1, cfg.vocab_size, (1, 32), generator=gen)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        dense(ids, labels=ids, cu_seqlens=torch.tensor([0, 9, 32]))


@pytest.mark.slow
def test_the_trainer_compiles_under_deepspeed_with_the_memory_options(tmp_path):
    """`--compile` as shipped, on two DeepSpeed ranks folding EP 2 and SP 2, with LoRA, full recompute, offloaded
    activations, MoE tiles and packed documents: the same losses and gradient norms as the eager run.

    The model is the tiny preset cut to one layer of each attention kind (the first a dense KDA layer, then a DSA
    MoE layer) with 2 Sinkhorn iterations: every region's kind at about half the tiny preset's compile time
    (65 s instead of 114 s for the compiled run's first step on a 2-core machine)."""
    text = dict(tiny().to_text_dict(), num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"], hc_sinkhorn_iters=2)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(text))
    common = ["--model-config", str(tmp_path / "config.json"), "--train-iters", "2", "--seq-length", "32",
              "--ep", "2", "--sp", "2", "--lora-rank", "8", "--recompute", "full", "--offload-activations",
              "--moe-tile-mib", "1"]  # fmt: skip
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "--compile-backend", "aot_eager"])):
        proc = deepspeed_run(2, *common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = [(r["lm_loss"], r["grad_norm"]) for r in metrics(tmp_path / name)]
    assert "--compile: 4 regions (aot_eager" in proc.stdout + proc.stderr
    assert len(runs["eager"]) == 2
    for (loss, norm), (c_loss, c_norm) in zip(runs["eager"], runs["compiled"], strict=True):
        assert abs(c_loss - loss) <= 1e-5 * loss and abs(c_norm - norm) <= 1e-4 * norm, runs
