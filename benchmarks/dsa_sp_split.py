"""One rank's DSA sparse attention under sequence parallelism SP: split by query (layers/mla.py) vs split by head.

Each rank of an SP group of N either attends its own S/N queries with all H heads against the whole row's latent
(split by query, what mla.py does) or all S queries with H/N heads (split by head, Ulysses, what it did before).
The FLOPs are the same; what differs is the rows each rank gathers (and, in the backward, buffers): S/N x W or S x
W. This measures that one rank's attention core, forward + backward (`sparse_latent_attention`: the torch
reference on CPU, the Triton kernels on CUDA), for each SP size, in one run:
  - CPU: process CPU time with one thread (the machines are shared), median of 3, wall time beside it;
    CUDA: CUDA-synchronised wall time, median of 3;
  - peak memory of the tensors the step allocates (`measure.peak_extra_bytes`: on CUDA everything; on CPU what
    autograd allocates and the custom op's outputs, not the reference's blocks inside it);
for the busiest rank of a query split (the last one: every query there sees W slots) and for any rank of a head split.

    python3 benchmarks/dsa_sp_split.py [--tokens 4096] [--heads 16] [--rank 128] [--topk 256] [--kpool 16]
        [--sp 2 4 8] [--device cpu|cuda]

(the CPU default is the released shape scaled down: 64 heads, latent 512, topk 2048 divided by 4, 4 and 8; on
CUDA pass the released one: --tokens 32768 --heads 64 --rank 512 --topk 2048.) Last line:
`dsa_sp_split head_vs_query_time_sp<N>=… head_vs_query_memory_sp<N>=…` (how many times the head split's time and
memory are the query split's). JSON: benchmarks/results/dsa_sp_split_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.dsa_kernel import selection  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    cpu_and_wall,
    device_description,
    peak_extra_bytes,
    print_table,
    write_results,
)
from glm53_ds.layers.sparse_attention import sparse_latent_attention  # noqa: E402


def rank_step(q: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, impl: str) -> torch.Tensor:
    """One rank's attention core, forward + backward: (dq, d_latent) of a random output gradient."""
    q, latent = q.detach().requires_grad_(True), latent.detach().requires_grad_(True)
    out = sparse_latent_attention(q, latent, tokens, q.shape[-1] ** -0.5, impl=impl, blind_possible=False)
    grad = torch.ones_like(out)
    return torch.autograd.grad(out, (q, latent), grad)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--kpool", type=int, default=16)
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    impl = "triton" if device.type == "cuda" else "sparse"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    length, heads = args.tokens, args.heads
    q = torch.randn(1, length, heads, args.rank, generator=g, device=device).to(dtype)
    latent = torch.randn(1, length, args.rank, generator=g, device=device).to(dtype)
    tokens = selection(length, args.topk, args.kpool, device)
    rows, last = [], ""
    for sp in args.sp:
        if length % sp or heads % sp:
            raise SystemExit(f"error: --sp {sp} must divide --tokens {length} and --heads {heads}")
        shard = length // sp
        cases = {  # the busiest rank of the query split: the last S/N queries, all heads
            "by_query": (q[:, length - shard :], latent, tokens[:, length - shard :]),
            "by_head": (q[:, :, : heads // sp], latent, tokens),  # any rank: all queries, H/N heads
        }
        row: dict[str, Any] = dict(sp=sp, tokens=length, heads=heads)
        for name, (qs, cs, ts) in cases.items():
            qs = qs.contiguous()

            def step(qs: torch.Tensor = qs, cs: torch.Tensor = cs, ts: torch.Tensor = ts) -> Any:
                return rank_step(qs, cs, ts, impl)

            cpu, wall = cpu_and_wall(step, device, args.repeats)
            peak = peak_extra_bytes(step, [qs, cs, ts])
            row.update({f"{name}_cpu_s": cpu, f"{name}_wall_s": wall, f"{name}_peak_mib": peak / 2**20})
        timing = "wall" if device.type == "cuda" else "cpu"
        row["head_vs_query_time"] = row[f"by_head_{timing}_s"] / row[f"by_query_{timing}_s"]
        row["head_vs_query_memory"] = row["by_head_peak_mib"] / row["by_query_peak_mib"]
        rows.append(row)
        last += f" head_vs_query_time_sp{sp}={row['head_vs_query_time']:.2f}"
        last += f" head_vs_query_memory_sp{sp}={row['head_vs_query_memory']:.2f}"
    print_table(rows, list(rows[0]))
    path = write_results(
        f"dsa_sp_split_{device.type}",
        dict(device=device_description(device), impl=impl, rank=args.rank, topk=args.topk, kpool=args.kpool,
             width=tokens.shape[-1], rows=rows),
    )  # fmt: skip
    print(f"results: {path}")
    print("dsa_sp_split" + last)


if __name__ == "__main__":
    main()
