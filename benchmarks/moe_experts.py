"""Routed experts, forward + backward: the per-expert reference loop vs grouped GEMMs (`moe_impl`), in one run.

`GroupedExperts` alone (router output given: top-k ids drawn uniformly over the local experts, fp32 weights), input
gradient and both expert gradients. CPU (default): T = 4096 tokens, D = 512, I = 256, top-8, with 8, 32 and 64
local experts, fp32; process CPU time with one thread (the machines are shared) and wall time, medians of 3.
The loop's cost grows with E twice over: a host sync and a GEMM pair per expert, and a full-size zero-filled
gradient per expert in backward (`SelectBackward` of `w[e]`): O(E² I D) memory traffic.

`--size real` (a GPU): the released width, D 4096, I 2048, 36 local experts (288 / EP 8), 16k tokens, top-8, bf16;
TFLOP/s of each (6 T k D I flops forward, twice that backward) and the ratio. Both paths' outputs and gradients are
compared (`max_rel_err`, relative to each tensor's largest entry).

Host syncs per MoE layer: one `Glm53MoE` layer (router, sort, grouped experts, shared expert) fwd + bwd at EP = 1
under `HostSyncCounter`, and its aten-op count beside the loop's.

    python3 benchmarks/moe_experts.py [--size cpu|real] [--experts 8 32 64] [--repeats 3] [--device cpu|cuda]

Last line: `moe_experts speedup_8=… speedup_32=… speedup_64=… syncs_per_layer=…` (speedup: loop time / grouped
time, CPU time on CPU, wall time on CUDA). JSON: benchmarks/results/moe_experts_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import cpu_and_wall, device_description, print_table, write_results  # noqa: E402
from glm53_ds.config import Glm53Config  # noqa: E402
from glm53_ds.flops import device_peak_tflops  # noqa: E402
from glm53_ds.host_syncs import HostSyncCounter  # noqa: E402
from glm53_ds.layers.moe import Glm53MoE, GroupedExperts  # noqa: E402
from glm53_ds.transformer_config import make_transformer_config  # noqa: E402
from tests.hf_reference import BASE_TEXT  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "cpu": dict(tokens=4096, hidden=512, inner=256, top_k=8, experts=[8, 32, 64], dtype=torch.float32),
    "real": dict(tokens=16384, hidden=4096, inner=2048, top_k=8, experts=[36], dtype=torch.bfloat16),
}


def config(hidden: int, inner: int, experts: int, top_k: int) -> Glm53Config:
    return Glm53Config.from_text_dict(
        dict(BASE_TEXT, hidden_size=hidden, moe_intermediate_size=inner, n_routed_experts=experts,
             num_experts_per_tok=top_k, n_group=1, topk_group=1, n_shared_experts=1, swiglu_limit=7.0,
             num_hidden_layers=1, mlp_layer_types=["sparse"], layer_types=["linear_attention"])
    )  # fmt: skip


def measure(size: dict[str, Any], experts: int, device: torch.device, repeats: int) -> dict[str, Any]:
    dtype = size["dtype"]
    tokens, hidden, inner, k = size["tokens"], size["hidden"], size["inner"], size["top_k"]
    with device:
        module = GroupedExperts(make_transformer_config(config(hidden, inner, experts, k), dtype))
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, hidden, dtype=dtype, generator=g, requires_grad=True)
        ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]  # k distinct experts, uniform load
        weights = torch.rand(tokens, k, generator=g)
        grad = torch.randn(tokens, hidden, dtype=dtype, generator=g)
    row: dict[str, Any] = {"experts": experts}
    results = {}
    for impl in ("loop", "grouped"):
        module.moe_impl = impl

        def step() -> torch.Tensor:
            module.zero_grad(set_to_none=True)
            x.grad = None
            out = module(x, ids, weights)
            out.backward(grad)
            return out

        row[f"{impl}_cpu_s"], row[f"{impl}_wall_s"] = cpu_and_wall(step, device, repeats)
        out = step()  # the last step's output and gradients, for the comparison below
        results[impl] = [
            t.detach().float() for t in (out, x.grad, module.gate_up_proj.grad, module.down_proj.grad)
        ]
    # the same work: grouped vs loop, output and gradients, relative to each tensor's largest entry
    row["max_rel_err"] = max(
        ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(results["loop"], results["grouped"], strict=True)
    )
    key = "wall_s" if device.type == "cuda" else "cpu_s"
    row["speedup"] = row[f"loop_{key}"] / row[f"grouped_{key}"]
    flops = 3 * 6 * tokens * k * hidden * inner  # forward 6 T k D I, backward twice that
    peak = device_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    for impl in ("loop", "grouped"):
        row[f"{impl}_tflops"] = flops / row[f"{impl}_{key}"] / 1e12
        if peak:
            row[f"{impl}_mfu"] = row[f"{impl}_tflops"] / peak
    return row


def moe_layer_counts(size: dict[str, Any], experts: int, device: torch.device) -> dict[str, Any]:
    """Host syncs and aten ops of one MoE layer's fwd + bwd (EP = 1), grouped vs loop."""
    hidden, inner, k = size["hidden"], size["inner"], size["top_k"]
    tokens = min(size["tokens"], 1024)
    with device:
        layer = Glm53MoE(make_transformer_config(config(hidden, inner, experts, k), size["dtype"]))
        x = torch.randn(tokens, 1, hidden, dtype=size["dtype"], requires_grad=True)
    out: dict[str, Any] = {}
    for impl in ("loop", "grouped"):
        layer.experts.moe_impl = impl
        with HostSyncCounter() as counter:
            layer(x)[0].float().square().sum().backward()
        out[f"{impl}_syncs"], out[f"{impl}_ops"] = counter.total_syncs, counter.total_ops
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--experts", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if args.size == "real" else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    size = SIZES[args.size]
    experts = args.experts or size["experts"]
    rows = [measure(size, e, device, args.repeats) for e in experts]
    counts = moe_layer_counts(size, experts[-1], device)
    print_table(rows, list(rows[0]))
    print(f"one MoE layer fwd+bwd: {counts}")
    payload = {
        "device": device_description(device),
        "size": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in size.items()},
        "rows": rows,
        "moe_layer": counts,
    }
    print(
        "results:",
        write_results(f"moe_experts_{device.type}" + ("" if args.size == "cpu" else "_real"), payload),
    )
    speedups = " ".join(f"speedup_{r['experts']}={r['speedup']:.2f}" for r in rows)
    print(f"moe_experts {speedups} syncs_per_layer={counts['grouped_syncs']}")


if __name__ == "__main__":
    main()
