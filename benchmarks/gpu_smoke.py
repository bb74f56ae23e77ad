"""Every project kernel compiled and launched once at the released width, forward and backward: the GPU check's
first step after the imports, so that a kernel that does not build or launch on the device is known within
seconds, before any benchmark spends the budget.

    DSA sparse attention (Triton)  64 heads, latent 512, W 2063 slots, 4,096 tokens, bf16
    hc_post (Triton)               4,096 tokens x 4 streams x hidden 4096, bf16 streams, fp32 weights
    routed experts (grouped GEMM)  36 local experts (288 / EP 8) of width 2048, hidden 4096, 4,096 tokens top-8, bf16

For each: the first call (compile + launch) and a second one, in seconds, one line as each finishes. KDA's fla
kernels are the next steps' (their autotuning takes minutes). `--small` (CPU, Triton's interpreter): toy sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import synchronize, write_results  # noqa: E402


def timed(device: torch.device, fn: Callable[[], object]) -> tuple[float, float]:
    """(first call, second call) in seconds."""
    times = []
    for _ in range(2):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times[0], times[1]


def dsa(device: torch.device, small: bool) -> Callable[[], object]:
    from glm53_ds.layers.sparse_attention_triton import sparse_attention_triton

    heads, rank, slots, tokens = (4, 32, 15, 64) if small else (64, 512, 2063, 4096)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(
        1, tokens, heads, rank, device=device, generator=g, dtype=torch.bfloat16, requires_grad=True
    )
    c = torch.randn(1, tokens, rank, device=device, generator=g, dtype=torch.bfloat16, requires_grad=True)
    sel = torch.randint(0, tokens, (1, tokens, slots), device=device, generator=g, dtype=torch.int32)
    return lambda: sparse_attention_triton(q, c, sel, rank**-0.5).float().square().mean().backward()


def hc_post(device: torch.device, small: bool) -> Callable[[], object]:
    from glm53_ds.mhc import hc_post as op

    tokens, hidden = (64, 256) if small else (4096, 4096)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(tokens, 4, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    post, comb = torch.rand(tokens, 4, device=device), torch.rand(tokens, 4, 4, device=device)
    return lambda: op(x, res, post, comb, backend="triton").float().square().mean().backward()


def experts(device: torch.device, small: bool) -> Callable[[], object]:
    from glm53_ds.config import Glm53Config
    from glm53_ds.layers.moe.experts import GroupedExperts
    from glm53_ds.transformer_config import make_transformer_config
    from tests.model_fixtures import CONFIG_A

    n, inner, hidden, tokens = (8, 32, 64, 64) if small else (36, 2048, 4096, 4096)
    cfg = Glm53Config.from_text_dict(dict(CONFIG_A, hidden_size=hidden, moe_intermediate_size=inner,
                                          n_routed_experts=n, num_experts_per_tok=8, n_group=1, topk_group=1))  # fmt: skip
    with torch.device(device):
        module = GroupedExperts(make_transformer_config(cfg, torch.bfloat16))
        module.moe_impl = "grouped"
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.rand(tokens, n).argsort(-1)[:, :8]
        weights = torch.rand(tokens, 8)
    return lambda: module(x, ids, weights).float().square().mean().backward()


KERNELS = {"dsa sparse attention": dsa, "hc_post": hc_post, "routed experts (grouped GEMM)": experts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    rows, failed = [], 0
    for name, make in KERNELS.items():
        try:
            first, second = timed(device, make(device, args.small))
            rows.append(dict(kernel=name, first_s=first, second_s=second))
            print(f"smoke: {name}: compiled and ran fwd+bwd, first call {first:.2f} s, second {second * 1e3:.1f} ms",
                  flush=True)  # fmt: skip
        except Exception as e:  # one line each; the next kernel still runs
            failed += 1
            rows.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"smoke: {name}: FAILED {type(e).__name__}: {e}"[:400], flush=True)
    write_results(f"gpu_smoke_{device.type}", dict(rows=rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
