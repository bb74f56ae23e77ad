"""hc_post benchmark: eager vs fused Triton vs HF's expression; and mHC's Sinkhorn, the torch Function vs its fused
Triton kernels.

For each (tokens, hc_mult, hidden, dtype): forward and forward+backward time, bytes moved by an ideal forward
(read x, residual, post, comb; write the output), achieved GB/s and % of the measured copy bandwidth, and peak
extra memory of the forward (beyond the inputs, the output included) for each path.
On CPU it runs the eager path and the HF expression; the fused kernels run where a GPU is present.

    python3 benchmarks/hc_post.py                       # default sizes for the device
    python3 benchmarks/hc_post.py --tokens 16384 --hidden 4096 --hc-mult 4 --dtype bf16

Sinkhorn (hc_pre's mixing weights, fp32, 20 iterations) at the largest token count: forward+backward time of the
tokens-last torch Function (about 240 kernel launches per call on a GPU) and, on a GPU, of the fused kernels
(`sinkhorn_impl=triton`).

Last line: `hc_post eager_mem_ratio_vs_hf=<eager peak / HF peak>` (+ ` fused_speedup=<HF fwd+bwd / fused>
sinkhorn_fused_speedup=<torch Function fwd+bwd / fused kernels>` on a GPU), for the last size measured. JSON goes to benchmarks/results/hc_post_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import (  # noqa: E402
    copy_bandwidth,
    device_description,
    peak_extra_bytes,
    print_table,
    time_call,
    write_results,
)
from glm53_ds.mhc import hc_post, hc_post_hf_expression, sinkhorn  # noqa: E402
from glm53_ds.mhc.hc_post_op import hc_post_forward_eager  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(tokens: int, n: int, d: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(tokens, d, generator=g, device=device).to(dtype),
        torch.randn(tokens, n, d, generator=g, device=device).to(dtype),
        2 * torch.rand(tokens, n, generator=g, device=device),
        torch.softmax(torch.randn(tokens, n, n, generator=g, device=device), dim=-1),
    ]


def forward_bytes(tokens: int, n: int, d: int, dtype: torch.dtype) -> int:
    act = torch.finfo(dtype).bits // 8
    return tokens * (d * act + 2 * n * d * act + (n + n * n) * 4)


def bench_one(
    tokens: int, n: int, d: int, dtype: torch.dtype, device: torch.device, copy_bw: float
) -> list[dict]:
    inputs = make_inputs(tokens, n, d, dtype, device)
    nbytes = forward_bytes(tokens, n, d, dtype)
    paths = {"hf_expression": hc_post_hf_expression, "eager": lambda *a: hc_post(*a, backend="eager")}
    # What each path allocates while running (implementation functions, so temporaries are visible).
    mem_fns = {"hf_expression": hc_post_hf_expression, "eager": hc_post_forward_eager}
    if device.type == "cuda":
        paths["fused"] = lambda *a: hc_post(*a, backend="triton")
        mem_fns["fused"] = paths["fused"]

    leaves = [t.clone().requires_grad_(True) for t in inputs]
    grad = torch.randn(inputs[1].shape, device=device).to(dtype)
    rows = []
    for name, fn in paths.items():
        with torch.no_grad():
            fwd = time_call(lambda fn=fn: fn(*inputs), device)

        def fwd_bwd(fn=fn) -> None:
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(grad)

        train = time_call(fwd_bwd, device)
        with torch.no_grad():
            mem = peak_extra_bytes(lambda name=name: mem_fns[name](*inputs), inputs)
        rows.append(
            dict(
                path=name,
                tokens=tokens,
                hc_mult=n,
                hidden=d,
                dtype=str(dtype).replace("torch.", ""),
                fwd_ms=fwd * 1e3,
                fwd_bwd_ms=train * 1e3,
                fwd_bytes=nbytes,
                fwd_GBps=nbytes / fwd / 1e9,
                pct_copy_bw=100 * (nbytes / fwd) / copy_bw,
                peak_extra_MiB=mem / 2**20,
            )
        )
    return rows


def bench_sinkhorn(tokens: int, n: int, device: torch.device, iters: int = 20) -> list[dict]:
    """Sinkhorn fwd+bwd as hc_pre runs it: the torch Function, and the fused kernels on a GPU."""
    g = torch.Generator(device=device).manual_seed(1)
    comb = torch.softmax(torch.randn(tokens, n, n, generator=g, device=device), dim=-1) + 1e-6
    comb.requires_grad_(True)
    weights = torch.randn(tokens, n, n, generator=g, device=device)
    rows = []
    for impl in ["torch"] + (["triton"] if device.type == "cuda" else []):

        def fwd_bwd(impl=impl) -> None:
            comb.grad = None
            (sinkhorn(comb, iters, 1e-6, impl) * weights).sum().backward()

        rows.append(
            dict(
                impl=impl, tokens=tokens, hc_mult=n, iters=iters, fwd_bwd_ms=time_call(fwd_bwd, device) * 1e3
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="*")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--hc-mult", type=int, default=4)
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="*")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="results file name (default hc_post_<device type>)")
    args = parser.parse_args()

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    tokens_list = args.tokens or ([4096, 16384] if on_gpu else [1024, 4096])
    hidden = args.hidden or (4096 if on_gpu else 1024)
    dtypes = [DTYPES[k] for k in (args.dtype or ["fp32", "bf16"])]

    copy_bw = copy_bandwidth(forward_bytes(max(tokens_list), args.hc_mult, hidden, torch.bfloat16), device)
    print(f"device: {device_description(device)}; measured copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    rows: list[dict] = []
    for dtype in dtypes:
        for tokens in tokens_list:
            rows.extend(bench_one(tokens, args.hc_mult, hidden, dtype, device, copy_bw))
    print_table(
        rows,
        ["path", "tokens", "hc_mult", "hidden", "dtype", "fwd_ms", "fwd_bwd_ms", "fwd_GBps", "pct_copy_bw",
         "peak_extra_MiB"],
    )  # fmt: skip

    sinkhorn_rows = bench_sinkhorn(max(tokens_list), args.hc_mult, device)
    print_table(sinkhorn_rows, ["impl", "tokens", "hc_mult", "iters", "fwd_bwd_ms"])

    last = {r["path"]: r for r in rows[-len(rows) // (len(dtypes) * len(tokens_list)) :]}
    summary = {
        "eager_mem_ratio_vs_hf": last["eager"]["peak_extra_MiB"] / last["hf_expression"]["peak_extra_MiB"]
    }
    if "fused" in last:
        summary["fused_speedup"] = last["hf_expression"]["fwd_bwd_ms"] / last["fused"]["fwd_bwd_ms"]
        summary["fused_mem_ratio_vs_hf"] = (
            last["fused"]["peak_extra_MiB"] / last["hf_expression"]["peak_extra_MiB"]
        )
    sinkhorn_ms = {r["impl"]: r["fwd_bwd_ms"] for r in sinkhorn_rows}
    if "triton" in sinkhorn_ms:
        summary["sinkhorn_fused_speedup"] = sinkhorn_ms["torch"] / sinkhorn_ms["triton"]
    path = write_results(
        args.out or f"hc_post_{device.type}",
        dict(
            device=device_description(device),
            copy_bandwidth_GBps=copy_bw / 1e9,
            rows=rows,
            sinkhorn=sinkhorn_rows,
            summary=summary,
        ),
    )
    print(f"results: {path}")
    line = f"hc_post eager_mem_ratio_vs_hf={summary['eager_mem_ratio_vs_hf']:.3f}"
    if "fused_speedup" in summary:
        line += f" fused_speedup={summary['fused_speedup']:.3f}"
    if "sinkhorn_fused_speedup" in summary:
        line += f" sinkhorn_fused_speedup={summary['sinkhorn_fused_speedup']:.3f}"
    print(line)


if __name__ == "__main__":
    main()
