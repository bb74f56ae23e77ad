"""The fused DSA sparse-attention kernel at the released width: correctness on the device, then speed and memory.

Released width (config, docs/numerics.md): 64 heads, kv_lora_rank R = 512 (the absorbed form's K = V), W =
index_topk + index_kpool - 1 = 2063 slots (kpool 16) or 2051 (kpool 4). Selections are realistic DSA ones: per query
the top K = topk / kpool of its visible complete pools by a random score, plus its tail, -1 beyond.

1. correctness at `--check-tokens` (default 2048): the kernel (`attention_impl=triton`) vs the torch reference
   (`sparse`), fp32 and bf16, output / dq_lat / d_latent relative errors, and bitwise determinism of the backward;
0. before measuring, the kernels' roofline model at 16k / 32k / 128k (and `--tokens`): FLOPs, bytes gathered and
   buffered per query, arithmetic intensity, the H200 roofline time (`model`); each measurement is then shown as
   a fraction of that time (`fwd_vs_roofline`, `bwd_vs_roofline`); and per rank under `--sp` (default 8): the
   attention split by query as mla.py does against split by head, beside dense SDPA on a rank's heads
   (`sp_model`);
2. per `--tokens` (default 16384 32768): forward and backward time of the kernel (CUDA events, median of 3), its
   achieved TFLOP/s (useful FLOPs: forward 4·L·W·H·R, backward 2.5× that), peak memory of forward + backward;
   beside it dense causal SDPA (flash, per-head q, k, v of 256 dims: dense attention's best case) on the same
   tokens and heads, its time and peak memory; and the backward's atomic alternative (`latent_grad="atomic"`:
   fp32 reductions into d_latent instead of the sorted buffer, not bitwise reproducible), its time and peak
   memory (`atomic_vs_sorted`: how much faster it is; the issue allows it as an option only if that pays).

3. the indexer (`DsaIndexer.select`, bf16, one sequence of each `--tokens`): its roofline model before (the torch
   path: every query's [Hi, P] fp32 scores through memory) and after (the streaming kernel: scores in registers, a
   running bitonic top-k on the CUDA cores), printed with the share of a 32k and a 128k DSA layer's time (the
   indexer's forward beside the sparse attention's forward + backward) it is predicted to take; then the share of
   queries whose selections the two paths make equal and, on CUDA, each path's time and peak memory beside its
   prediction (`indexer_run`).

    python3 benchmarks/dsa_kernel.py [--device cuda] [--tokens 16384 32768] [--kpool 16] [--small]

`--small` (the CPU dry run, Triton's interpreter): 4 heads, R 32, topk 16, 256 tokens. Last line:
`dsa_kernel fwd_tflops=… bwd_tflops=… speedup_vs_dense_at_<L>k=… atomic_vs_sorted=… max_err_fp32=…`. JSON:
benchmarks/results/dsa_kernel_<device>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if "--small" in sys.argv[1:]:  # before anything imports triton.language: `triton.jit` reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import (  # noqa: E402
    device_description,
    print_table,
    selective_init,
    synchronize,
    write_results,
)
from glm53_ds.flops import device_peak_tflops  # noqa: E402


def selection(length: int, topk: int, kpool: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """int32 [1, L, topk + kpool - 1]: each query's top topk/kpool visible complete pools (random scores) expanded to
    tokens, then its tail (the visible tokens after its last complete pool), -1 beyond. Built in blocks of queries."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_pools = length // kpool
    k = topk // kpool
    width = topk + kpool - 1
    out = torch.full((length, width), -1, dtype=torch.int32, device=device)
    block = max(1, (64 << 20) // (4 * max(n_pools, 1)))
    for start in range(0, length, block):
        end = min(start + block, length)
        q = torch.arange(start, end, device=device)
        visible_pools = (q + 1) // kpool  # complete pools whose last token is visible
        scores = torch.rand(end - start, n_pools, generator=g, device=device)
        scores = scores.masked_fill(
            torch.arange(n_pools, device=device)[None] >= visible_pools[:, None], -1.0
        )
        chosen = scores.topk(min(k, n_pools), dim=-1).indices  # [r, K]
        ok = chosen < visible_pools[:, None]
        tokens = (chosen[..., None] * kpool + torch.arange(kpool, device=device)).masked_fill(
            ~ok[..., None], -1
        )
        out[start:end, : tokens.shape[1] * kpool] = tokens.flatten(1).int()
        tail_start = visible_pools * kpool
        tail = tail_start[:, None] + torch.arange(kpool - 1, device=device)
        out[start:end, topk:] = torch.where(tail <= q[:, None], tail, -1).int()
    return out[None]


def cuda_time(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from glm53_ds.layers.sparse_attention import sparse_latent_attention

    tokens = selection(args.check_tokens, args.topk, args.kpool, device)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, args.check_tokens, args.heads, args.rank, generator=g, device=device)
    c = torch.randn(1, args.check_tokens, args.rank, generator=g, device=device)
    grad = torch.randn(q.shape, generator=g, device=device)
    scaling = args.dq**-0.5
    result: dict[str, Any] = {}

    def run(impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [q.to(dtype).requires_grad_(True), c.to(dtype).requires_grad_(True)]
        out = sparse_latent_attention(*leaves, tokens, scaling, impl=impl)
        dq, dc = torch.autograd.grad(out, leaves, grad.to(dtype))
        return [out.detach(), dq, dc]

    ref = run("sparse", torch.float32)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = run("triton", dtype)
        result[name] = {
            what: rel(a, r) for what, a, r in zip(("out", "dq", "d_latent"), got, ref, strict=True)
        }
        again = run("triton", dtype)
        result[name]["deterministic"] = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    # the backward's atomic alternative in bf16: d_latent vs the fp32 reference (the sorted path's is above)
    from glm53_ds.layers.sparse_attention_triton import sparse_backward, sparse_forward

    low = q.bfloat16(), c.bfloat16()
    out, lse = sparse_forward(*low, tokens, scaling)
    _, d_latent = sparse_backward(*low, tokens, out, lse, grad.bfloat16(), scaling, latent_grad="atomic")
    result["bf16_atomic"] = {"d_latent": rel(d_latent, ref[2])}
    return result


def speed(args: argparse.Namespace, device: torch.device, length: int) -> dict[str, Any]:
    from glm53_ds.layers.sparse_attention_triton import sparse_backward, sparse_forward

    dtype = torch.bfloat16
    tokens = selection(length, args.topk, args.kpool, device)
    width = tokens.shape[-1]
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(1, length, args.heads, args.rank, generator=g, device=device).to(dtype)
    c = torch.randn(1, length, args.rank, generator=g, device=device).to(dtype)
    grad = torch.randn(q.shape, generator=g, device=device).to(dtype)
    scaling = args.dq**-0.5
    state: dict[str, Any] = {}

    def forward() -> None:
        state["out"], state["lse"] = sparse_forward(q, c, tokens, scaling)

    def backward(latent_grad: str = "sorted") -> None:
        sparse_backward(q, c, tokens, state["out"], state["lse"], grad, scaling, latent_grad=latent_grad)

    def both(latent_grad: str = "sorted") -> None:
        forward()
        backward(latent_grad)

    fwd_s = cuda_time(forward, device)
    bwd_s = cuda_time(backward, device)
    peak = peak_bytes(both, device)
    atomic_s = cuda_time(lambda: backward("atomic"), device)
    atomic_peak = peak_bytes(lambda: both("atomic"), device)
    flops_fwd = 4.0 * length * width * args.heads * args.rank
    row: dict[str, Any] = dict(tokens=length, width=width, fwd_ms=fwd_s * 1e3, bwd_ms=bwd_s * 1e3,
                               fwd_tflops=flops_fwd / fwd_s / 1e12, bwd_tflops=2.5 * flops_fwd / bwd_s / 1e12,
                               peak_gib=None if peak is None else peak / 2**30)  # fmt: skip
    peak_tflops = device_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peak_tflops:
        row.update(fwd_mfu=row["fwd_tflops"] / peak_tflops, bwd_mfu=row["bwd_tflops"] / peak_tflops)
    # dense causal attention at the same heads, per-head dims dq = dv (flash SDPA: dense attention's best case)
    qd, kd, vd = (
        torch.randn(1, args.heads, length, args.dq, device=device, dtype=dtype).requires_grad_(True)
        for _ in range(3)
    )
    grad_d = torch.randn(1, args.heads, length, args.dq, device=device, dtype=dtype)

    def dense() -> None:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scaling)
        out.backward(grad_d)

    dense_s = cuda_time(dense, device)
    dense_peak = peak_bytes(dense, device)
    row.update(dense_fwd_bwd_ms=dense_s * 1e3, speedup_vs_dense=dense_s / (fwd_s + bwd_s),
               dense_peak_gib=None if dense_peak is None else dense_peak / 2**30,
               bwd_atomic_ms=atomic_s * 1e3, bwd_atomic_tflops=2.5 * flops_fwd / atomic_s / 1e12,
               atomic_vs_sorted=bwd_s / atomic_s, speedup_vs_dense_atomic=dense_s / (fwd_s + atomic_s),
               peak_atomic_gib=None if atomic_peak is None else atomic_peak / 2**30)  # fmt: skip
    return row


H200_TFLOPS, H200_TBPS = 989.0, 4.8  # dense bf16 tensor-core peak, HBM3e bandwidth


def model(length: int, heads: int, rank: int, width: int, dq: int) -> list[dict[str, Any]]:
    """The kernels' roofline model per query and at `length` tokens (bf16 operands and buffers; every gathered
    latent row counted as an HBM read, an upper bound where neighbouring queries' selections hit L2):
    useful FLOPs, the tensor work issued per useful FLOP, bytes gathered, buffered (written + read back) and
    otherwise moved, arithmetic intensity, and the H200 roofline time max(issued FLOPs / peak, bytes / bandwidth);
    `roofline_tflops` counts the useful FLOPs; `gathers_in_l2_ms` the same time were every gathered row an L2 hit
    (the lower bound)."""
    w_eff = (
        (width * (width + 1) / 2 + max(0, length - width) * width) / length
        if length > width
        else (length + 1) / 2
    )
    gather = w_eff * rank * 2  # the selected latent rows, bf16
    heads_io = heads * rank * 2  # one [h, R] bf16 tile (q, dO, out or dq)
    g = w_eff * rank * 2  # the backward's buffer per query: each slot's latent gradient (bf16: dsa_workspace)
    product = 2 * heads * w_eff * rank  # one [h x W x R] matrix product
    # The forward's scores q c^T at 64 heads are computed whole on both warpgroups (Triton's layout for a product
    # feeding a product; `benchmarks/sm90_compile.py` reports it, tests/test_sm90_compile.py asserts it): the
    # tensor cores issue 3 products' work for its 2. Below 64 heads (Ampere-style MMAs, warps along the slots) and
    # in the backward (its products have 128 or 512 rows), each product is issued once. The backward pads 17 to 32
    # heads to its 64-head tile: twice the issued work there.
    score_copies = 2 if heads >= 64 else 1
    padding = 64 / heads if 16 < heads < 64 else 1
    # The backward, one fused kernel per query (bf16): the five products (s and dp as one, dq, the slot gradients
    # as one), each latent row gathered once, q and dO read and dq written once, the slot gradients written; then
    # the segment sum reads them back. The atomic alternative's fp32 reductions into d_latent instead: 4 B per
    # slot and latent column, counted like any other byte at HBM bandwidth, which makes them cost what the sorted
    # path's buffer write and read back cost (2 + 2 B): where they run at L2 speed (d_latent [L, R] fp32 fits the
    # 50 MB L2 to ~25k tokens) is what only a measurement shows.
    kernels = [  # path (sparse: both backwards), name, useful FLOPs, issued FLOPs, bytes gathered, buffered, other
        ("sparse", "forward", 2 * product, (score_copies + 1) * product, gather, 0, 2 * heads_io),
        ("sorted", "bwd fused (5 products)", 5 * product, 5 * product * padding, gather, g, 3 * heads_io),
        ("sorted", "bwd segment sum", w_eff * rank, w_eff * rank, 0, g, 0),
        ("atomic", "bwd fused, atomic", 5 * product, 5 * product * padding, gather, 0, 3 * heads_io + 2 * g),
    ]
    # dense causal flash SDPA at the same heads, per-head q, k, v of dq dims: forward 4 h (L/2) dq per query
    dense = 4 * heads * (length / 2) * dq
    kernels.append(("dense", "dense causal SDPA fwd+bwd", 3.5 * dense, 3.5 * dense, 0, 0, 4 * heads * dq * 2))
    rows = []
    for path, name, flops, issued, gathered, buffered, other in kernels:
        moved = gathered + buffered + other
        seconds = max(issued / (H200_TFLOPS * 1e12), moved / (H200_TBPS * 1e12)) * length
        l2_seconds = max(issued / (H200_TFLOPS * 1e12), (moved - gathered) / (H200_TBPS * 1e12)) * length
        rows.append(dict(kernel=name, path=path, tokens=length, mflop_per_query=flops / 1e6,
                         issued_vs_useful=issued / flops, gathered_MB=gathered / 1e6, buffered_MB=buffered / 1e6,
                         flop_per_byte=flops / moved if moved else float("inf"), roofline_ms=seconds * 1e3,
                         roofline_tflops=flops * length / seconds / 1e12, gathers_in_l2_ms=l2_seconds * 1e3))  # fmt: skip
    return rows


def build_indexer(args: argparse.Namespace, device: torch.device, hidden: int, q_rank: int) -> Any:
    """A `DsaIndexer` of the benchmark's sizes, bf16, with unit-variance projections (a selective indexer)."""
    import glm53_ds
    from glm53_ds.layers.dsa_indexer import DsaIndexer

    text = dict(hidden_size=hidden, q_lora_rank=q_rank, index_n_heads=args.indexer_heads,
                index_head_dim=args.indexer_dim, index_topk=args.topk, index_kpool=args.kpool,
                index_kpool_always_select_tail=True, num_hidden_layers=1, layer_types=["indexed_attention"],
                indexer_types=["full"], mlp_layer_types=["dense"])  # fmt: skip
    glm53_ds.model.ensure_model_parallel()
    torch.manual_seed(0)
    indexer = DsaIndexer(
        glm53_ds.make_transformer_config(glm53_ds.Glm53Config.from_text_dict(text), torch.bfloat16)
    )
    selective_init(indexer)
    return indexer.to(device).eval()


def indexer_run(args: argparse.Namespace, device: torch.device, length: int) -> dict[str, Any]:
    """The indexer's selection of `length` queries (one sequence, bf16) through `DsaIndexer.select`, the torch path
    and the streaming kernel: the share of queries whose selections are equal (the rest: exactly tied or
    ulp-close scores ordered differently, `indexer_topk.py`) and, on CUDA, each one's time (CUDA events, median of
    3) and peak memory beside the model's roofline time."""
    hidden, q_rank = (64, 32) if args.small else (4096, 2048)
    indexer = build_indexer(args, device, hidden, q_rank)
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(1, length, hidden, generator=g, device=device).bfloat16()
    q_resid = torch.randn(1, length, q_rank, generator=g, device=device).bfloat16()
    mask = torch.ones(1, length, dtype=torch.bool, device=device)
    with torch.no_grad():
        pools = indexer.pools(indexer.keys(x), mask, real_length=length)

    def select(impl: str) -> Any:
        indexer.indexer_impl = impl
        with torch.no_grad():
            return indexer.select(x, q_resid, mask, pools)

    torch_path, kernel = select("torch").tokens, select("triton").tokens
    row: dict[str, Any] = dict(tokens=length, kpool=args.kpool, chosen=args.topk // args.kpool,
                               equal_rows=float((torch_path == kernel).all(-1).float().mean()))  # fmt: skip
    if device.type == "cuda":
        for impl in ("torch", "triton"):
            row[f"{impl}_ms"] = cuda_time(lambda impl=impl: select(impl), device) * 1e3
            peak = peak_bytes(lambda impl=impl: select(impl), device)
            row[f"{impl}_peak_gib"] = None if peak is None else peak / 2**30
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


# the released indexer (config: index_n_heads, index_head_dim); INT32 instructions per second of an H200 (132 SMs x 64
# INT32 lanes x 1.98 GHz); the int32 instructions per key and stage of the kernel's bitonic network on int64 keys
# (its xor exchange, a 64-bit compare, two 32-bit selects: an estimate from the generated code's shape)
INDEXER_HEADS, INDEXER_DIM = 32, 128
H200_INT_TOPS, SORT_OPS = 16.7, 8
INDEXER_QUERY_BLOCK = 4  # queries per program of the kernel at 32 heads (ROWS 128 / 32)


def indexer_model(length: int, heads: int, dim: int, kpool: int, topk: int) -> list[dict[str, Any]]:
    """The indexer's scores and top-k per query at `length` tokens, before (the torch path, `indexer_impl=torch`)
    and after (the streaming kernel, `indexer_topk_triton.py`), on the H200 roofline: time = max(tensor FLOPs /
    peak, bytes / HBM bandwidth, int32 instructions / INT32 rate) per query x length.
    - torch path: every query scores all P = L / kpool pools (the causal mask comes after): q k^T [Hi, P] fp32
      written, scaled and ReLU'd (two passes, each a read and a write), read by the head weighting, which writes
      [P]; the mask (read, write) and topk (read). Memory-bound: 24 Hi + 16 bytes per pool.
    - kernel: each query scores the pools up to its block's reach (causal: (P + 1) / 2 on average, rounded up to
      the K2 of a step); the pool keys are read once per block of `INDEXER_QUERY_BLOCK` queries (counted at HBM
      bandwidth: an upper bound, 2 MB of keys at 128k fit the L2); q, the head weights and the K chosen pools once.
      Its running top-k: per K2 pools a bitonic sort of K2 keys (s (s + 1) / 2 stages, s = log2 K2) and one merge
      (s stages), every key in every stage, `SORT_OPS` int32 instructions each, on the CUDA cores."""
    pools = length / kpool
    chosen = topk // kpool
    k2 = max(16, 1 << (chosen - 1).bit_length())
    stages = k2.bit_length() - 1
    visible = math.ceil((pools + 1) / 2 / k2) * k2
    per_pool_flops = 2 * heads * dim + 2 * heads
    paths = {
        "indexer, torch path": (per_pool_flops * pools, (24 * heads + 16) * pools, 0.0),
        "indexer, streaming kernel": (
            per_pool_flops * visible,
            visible * dim * 2 / INDEXER_QUERY_BLOCK + heads * (dim * 2 + 4) + chosen * 4,
            visible * (stages * (stages + 1) / 2 + stages) * SORT_OPS,
        ),
    }
    rows = []
    for name, (flops, moved, int_ops) in paths.items():
        times = {"tensor": flops / (H200_TFLOPS * 1e12), "memory": moved / (H200_TBPS * 1e12),
                 "int32 (top-k)": int_ops / (H200_INT_TOPS * 1e12)}  # fmt: skip
        bound = max(times, key=lambda k: times[k])
        rows.append(dict(kernel=name, tokens=length, kpool=kpool, chosen=chosen, mflop_per_query=flops / 1e6,
                         mb_per_query=moved / 1e6, int_mops_per_query=int_ops / 1e6, bound=bound,
                         roofline_ms=times[bound] * length * 1e3))  # fmt: skip
    return rows


def sp_model(length: int, heads: int, rank: int, width: int, dq: int, sp: int) -> dict[str, Any]:
    """One layer's sparse fwd+bwd per rank under sequence parallelism SP (the H200 roofline of `model`, gathers from
    HBM to L2): split by query as mla.py does (the busiest rank: S/SP queries of W slots each, all heads) and, for
    comparison, split by head as KDA is (every rank all S queries of H/SP heads); beside dense causal SDPA on H/SP
    heads (the same per rank either way)."""
    whole = model(length, heads, rank, width, dq)
    by_head = model(length, heads // sp, rank, width, dq)

    def total(rows: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rows if r["path"] in ("sparse", "sorted"))

    w_eff = (width * (width + 1) / 2 + max(0, length - width) * width) / length if length > width else width
    busiest = (length / sp) * min(width, length) / (length * w_eff)  # its share of the slot references
    dense = next(r["roofline_ms"] for r in by_head if r["path"] == "dense")
    query_ms = (total(whole, "roofline_ms") * busiest, total(whole, "gathers_in_l2_ms") * busiest)
    head_ms = (total(by_head, "roofline_ms"), total(by_head, "gathers_in_l2_ms"))
    return dict(tokens=length, sp=sp, heads_per_rank_by_head=heads // sp, by_query_ms=query_ms[0],
                by_query_l2_ms=query_ms[1], by_head_ms=head_ms[0], by_head_l2_ms=head_ms[1], dense_ms=dense,
                by_query_vs_dense=dense / query_ms[0], by_head_vs_dense=dense / head_ms[0])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--check-tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--dq", type=int, default=256)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--kpool", type=int, default=16)
    parser.add_argument("--sp", type=int, nargs="+", default=[8], help="SP sizes of the per-rank prediction")
    parser.add_argument("--indexer-heads", type=int, default=INDEXER_HEADS)
    parser.add_argument("--indexer-dim", type=int, default=INDEXER_DIM)
    parser.add_argument("--small", action="store_true", help="CPU dry run sizes (Triton interpreter)")
    args = parser.parse_args()
    if args.small:  # (TRITON_INTERPRET=1: set at import)
        args.heads, args.rank, args.dq, args.topk, args.kpool = 4, 32, 16, 16, 4
        args.indexer_heads, args.indexer_dim = 4, 16
        args.tokens, args.check_tokens, args.sp = [256], 64, [2]
    device = torch.device(args.device)
    width = args.topk + args.kpool - 1
    predicted = [
        r
        for length in sorted({*args.tokens, 16384, 32768, 131072})
        for r in model(length, args.heads, args.rank, width, args.dq)
    ]
    print("prediction (H200 roofline, before measuring):")
    print_table(predicted, list(predicted[0]))
    for length in sorted({r["tokens"] for r in predicted}):
        at = [r for r in predicted if r["tokens"] == length]
        dense = next(r["roofline_ms"] for r in at if r["path"] == "dense")
        hbm = sum(r["roofline_ms"] for r in at if r["path"] in ("sparse", "sorted"))
        l2 = sum(r["gathers_in_l2_ms"] for r in at if r["path"] in ("sparse", "sorted"))
        buffer = next(r["roofline_ms"] for r in at if r["kernel"] == "bwd segment sum")
        print(f"predicted at {length} tokens: sparse fwd+bwd {hbm:.1f} ms (gathers from HBM) to {l2:.1f} ms (from L2), "
              f"of which {buffer:.1f} ms reads the slot gradients back; dense causal SDPA {dense:.1f} ms: "
              f"{dense / hbm:.2f}x to {dense / l2:.2f}x at the roofline")  # fmt: skip
        hbm = sum(r["roofline_ms"] for r in at if r["path"] in ("sparse", "atomic"))
        l2 = sum(r["gathers_in_l2_ms"] for r in at if r["path"] in ("sparse", "atomic"))
        print(f"  with the atomic backward: {hbm:.1f} to {l2:.1f} ms, {dense / hbm:.2f}x to {dense / l2:.2f}x (its "
              f"reductions counted at HBM bandwidth; at L2 speed they would cost less)")  # fmt: skip
    indexer = [
        r
        for length in sorted({*args.tokens, 32768, 131072})
        for r in indexer_model(length, args.indexer_heads, args.indexer_dim, args.kpool, args.topk)
    ]
    print("indexer prediction (H200 roofline, before measuring):")
    print_table(indexer, list(indexer[0]))
    for length in (32768, 131072):
        at = [r for r in predicted if r["tokens"] == length]
        attention = sum(r["roofline_ms"] for r in at if r["path"] in ("sparse", "sorted"))
        before, after = (r for r in indexer if r["tokens"] == length)
        print(f"predicted share of a DSA layer's time at {length} tokens (kpool {args.kpool}) taken by the indexer "
              f"(its forward, beside the sparse attention's forward + backward, {attention:.1f} ms): before "
              f"{before['roofline_ms'] / (before['roofline_ms'] + attention):.0%} ({before['roofline_ms']:.1f} ms, "
              f"{before['bound']}-bound), after {after['roofline_ms'] / (after['roofline_ms'] + attention):.0%} "
              f"({after['roofline_ms']:.1f} ms, {after['bound']}-bound)")  # fmt: skip
    per_rank = [
        sp_model(length, args.heads, args.rank, width, args.dq, sp)
        for sp in args.sp
        if args.heads % sp == 0
        for length in sorted({r["tokens"] for r in predicted})
    ]
    for r in per_rank:
        print(f"predicted per rank at SP {r['sp']}, {r['tokens']} tokens: split by query (mla.py) "
              f"{r['by_query_ms']:.1f}-{r['by_query_l2_ms']:.1f} ms, split by head ({r['heads_per_rank_by_head']} "
              f"heads, every query) {r['by_head_ms']:.1f}-{r['by_head_l2_ms']:.1f} ms; dense causal SDPA on those "
              f"heads {r['dense_ms']:.1f} ms: {r['by_query_vs_dense']:.2f}x vs {r['by_head_vs_dense']:.2f}x")  # fmt: skip
    correctness = check(args, device)
    print("correctness vs the torch reference:", correctness)
    rows = [speed(args, device, length) for length in args.tokens]
    for row in rows:  # the measurement beside the model's roofline of the same kernels
        by = {r["kernel"]: r for r in predicted if r["tokens"] == row["tokens"]}
        row["fwd_vs_roofline"] = by["forward"]["roofline_ms"] / row["fwd_ms"]
        backward = [r for r in by.values() if r["kernel"].startswith("bwd") and r["path"] != "atomic"]
        bwd_model = sum(r["roofline_ms"] for r in backward)
        row["bwd_vs_roofline"] = bwd_model / row["bwd_ms"]
    print_table(rows, list(rows[0]))
    indexer_rows = [indexer_run(args, device, length) for length in args.tokens]
    for row in indexer_rows:  # beside the roofline of the same path
        by = {r["kernel"]: r["roofline_ms"] for r in indexer if r["tokens"] == row["tokens"]}
        row["predicted_torch_ms"], row["predicted_triton_ms"] = (
            by["indexer, torch path"],
            by["indexer, streaming kernel"],
        )
    print("the indexer, torch path vs the streaming kernel:")
    print_table(indexer_rows, list(indexer_rows[0]))
    path = write_results(
        f"dsa_kernel_{device.type}",
        dict(device=device_description(device), heads=args.heads, rank=args.rank, topk=args.topk,
             kpool=args.kpool, correctness=correctness, rows=rows, prediction=predicted,
             prediction_per_rank=per_rank, indexer_prediction=indexer, indexer=indexer_rows),
    )  # fmt: skip
    print(f"results: {path}")
    last = rows[-1]
    worst = max(correctness["fp32"][k] for k in ("out", "dq", "d_latent"))
    print(
        f"dsa_kernel fwd_tflops={last['fwd_tflops']:.1f} bwd_tflops={last['bwd_tflops']:.1f} "
        f"speedup_vs_dense_at_{last['tokens'] // 1024}k={last['speedup_vs_dense']:.2f} "
        f"atomic_vs_sorted={last['atomic_vs_sorted']:.2f} max_err_fp32={worst:.1e} "
        f"deterministic={correctness['bf16']['deterministic'] and correctness['fp32']['deterministic']}"
    )


if __name__ == "__main__":
    main()
