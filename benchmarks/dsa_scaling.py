"""How one DSA layer's cost grows with the sequence length: today's dense path vs the sparse reference, in one run.

One `SparseMLA` layer (its DSA indexer included) at reduced width with W fixed: 8 heads x 64 dims, latent 128, an
indexer of 4 heads x 32 (the released 64 x 256 / 512 / 32 x 128 divided by 8 heads and 4 dims), index_topk 256,
index_kpool 16 with the tail (W = 271), hidden 512. For L = 2k, 4k, 8k, 16k tokens (one sequence) it measures a
forward + backward (input gradient and every trainable parameter's) of `attention_impl=dense` (masked SDPA over all
L keys) and `sparse` (the absorbed-latent gather, `layers/sparse_attention.py`):
  - process CPU time with one thread (the machines are shared: wall time swings), median of 3, wall time beside it;
  - peak memory of the tensors the step allocates (`measure.peak_extra_bytes`, a separate run);
  - the indexer's share (its scoring and selection, forward only: it gets no gradient) and the attention core's
    share (fwd + bwd) of the layer's CPU time;
and fits each growth exponent in L (least squares on log-log, over L >= 2W).

    python3 benchmarks/dsa_scaling.py [--lengths 2048 4096 8192 16384] [--repeats 3] [--device cpu|cuda]

Last line: `dsa_scaling sparse_time_exp=… sparse_mem_exp=… dense_time_exp=… speedup_at_16k=…` (speedup: dense
CPU time / sparse CPU time at the longest length). JSON: benchmarks/results/dsa_scaling_<device>.json.
Goal: sparse exponents <= 1.15 (time) and <= 1.1 (memory), dense time ~2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import (  # noqa: E402
    cpu_and_wall,
    device_description,
    peak_extra_bytes,
    print_table,
    selective_init,
    write_results,
)
from tests.hf_reference import BASE_TEXT  # noqa: E402

TEXT = dict(
    BASE_TEXT,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    qk_nope_head_dim=64,
    v_head_dim=64,
    kv_lora_rank=128,
    q_lora_rank=384,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=256,
    index_kpool=16,
    index_kpool_always_select_tail=True,
    num_hidden_layers=2,
    layer_types=["linear_attention", "indexed_attention"],
    indexer_types=["full", "full"],
    mlp_layer_types=["dense", "dense"],
)


def build_layer(impl: str, device: torch.device) -> Any:
    import glm53_ds
    from glm53_ds.layers.mla import SparseMLA

    cfg = glm53_ds.Glm53Config.from_text_dict(TEXT)
    torch.manual_seed(0)
    layer = SparseMLA(
        glm53_ds.make_transformer_config(cfg, torch.float32, attention_impl=impl), layer_index=1
    )
    selective_init(layer)
    return layer.to(device).train()


def fit_exponent(lengths: list[int], values: list[float]) -> float:
    xs, ys = [math.log(x) for x in lengths], [math.log(y) for y in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def measure(impl: str, length: int, device: torch.device, repeats: int) -> dict[str, Any]:
    from glm53_ds.layers.mla import dense_attention
    from glm53_ds.layers.sparse_attention import absorb_query, sparse_latent_attention

    layer = build_layer(impl, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(length, 1, TEXT["hidden_size"], generator=g, device=device).requires_grad_(True)
    grad = torch.randn(length, 1, TEXT["hidden_size"], generator=g, device=device)

    def step() -> None:
        out, _ = layer(x)
        out.backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    with torch.no_grad():  # the indexer's and the attention core's inputs, as the layer computes them
        xb = x.detach().transpose(0, 1)
        mask = torch.ones(1, length, dtype=torch.bool, device=device)
        q_resid = layer.q_a_layernorm(layer.q_a_proj(xb))
        q = layer.q_b_proj(q_resid).view(1, length, layer.num_heads, layer.qk_head_dim)
        latent = layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(xb))
        topk = layer.indexer(xb, q_resid, mask)
        w = layer.kv_b_proj.weight.view(layer.num_heads, -1, layer.kv_lora_rank)
        w_uk = w[:, : layer.qk_head_dim]
        kv = layer.kv_b_proj(latent).view(1, length, layer.num_heads, -1)
        k, v = kv.split([layer.qk_head_dim, layer.v_head_dim], dim=-1)
        q_lat = absorb_query(q, w_uk)

    def indexer() -> None:
        with torch.no_grad():
            layer.indexer(xb, q_resid, mask)

    if impl == "dense":
        leaves = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]

        def core() -> None:
            out = dense_attention(*leaves, topk, layer.scaling)
            out.sum().backward()
            for t in leaves:
                t.grad = None

    else:
        leaves = [q_lat.contiguous().requires_grad_(True), latent.contiguous().requires_grad_(True)]

        def core() -> None:
            out = sparse_latent_attention(*leaves, topk, layer.scaling, impl=impl)
            out.sum().backward()
            for t in leaves:
                t.grad = None

    cpu, wall = cpu_and_wall(step, device, repeats)
    indexer_cpu, _ = cpu_and_wall(indexer, device, repeats)
    core_cpu, _ = cpu_and_wall(core, device, repeats)
    peak = peak_extra_bytes(step, [x, grad, *layer.parameters()])
    return dict(impl=impl, tokens=length, cpu_s=cpu, wall_s=wall, peak_mib=peak / 2**20,
                indexer_share=indexer_cpu / cpu, attention_share=core_cpu / cpu)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impls", nargs="+", default=["dense", "sparse"])
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    width = TEXT["index_topk"] + TEXT["index_kpool"] - 1
    rows = []
    for length in args.lengths:
        for impl in args.impls:
            rows.append(measure(impl, length, device, args.repeats))
            print_table(rows[-1:], list(rows[-1]))
            sys.stdout.flush()
    print_table(rows, ["impl", "tokens", "cpu_s", "wall_s", "peak_mib", "indexer_share", "attention_share"])
    fitted = [r for r in rows if r["tokens"] >= 2 * width]
    exponents = {}
    for impl in args.impls:
        mine = [r for r in fitted if r["impl"] == impl]
        if len(mine) >= 2:
            lengths = [r["tokens"] for r in mine]
            exponents[impl] = dict(
                time=fit_exponent(lengths, [r["cpu_s"] for r in mine]),
                memory=fit_exponent(lengths, [r["peak_mib"] for r in mine]),
            )
    longest = max(args.lengths)
    by = {(r["impl"], r["tokens"]): r for r in rows}
    speedup = (
        by[("dense", longest)]["cpu_s"] / by[("sparse", longest)]["cpu_s"]
        if ("dense", longest) in by and ("sparse", longest) in by
        else float("nan")
    )
    path = write_results(
        f"dsa_scaling_{device.type}",
        dict(device=device_description(device), config=TEXT, width=width, rows=rows, exponents=exponents,
             speedup_at_longest=speedup),
    )  # fmt: skip
    print(f"results: {path}")
    nan = float("nan")
    print(
        f"dsa_scaling sparse_time_exp={exponents.get('sparse', {}).get('time', nan):.3f} "
        f"sparse_mem_exp={exponents.get('sparse', {}).get('memory', nan):.3f} "
        f"dense_time_exp={exponents.get('dense', {}).get('time', nan):.3f} "
        f"speedup_at_{longest // 1024}k={speedup:.2f}"
    )


if __name__ == "__main__":
    main()
