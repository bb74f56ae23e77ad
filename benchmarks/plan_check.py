"""The activation planner against a real training step's peak (`glm53_ds/plan/activations.py`).

    python benchmarks/plan_check.py [--device cuda] [--hidden 1024] [--tokens 4096] [--layers 10]

A model of `--layers` layers of three kinds (KDA + dense MLP, DSA + MoE, KDA + MoE) and MTP at `--hidden`:
the planner's prediction (the reduced model's profile, one layer per kind, composed over the layers) vs the whole
model's step peak measured by the planner's live-storage tracker and, on CUDA, by the caching allocator
(`max_memory_allocated` above the step's start, parameter gradients dropped as they are accumulated, as the
tracker leaves them out). Each recompute mode, and full recompute with `offload_activations` and MoE tiles (on
CUDA the allocator sees the device alone: the host copies are not in it, as the planner says); bf16 on CUDA, fp32
on CPU. Ends with one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from glm53_ds.model import build_model  # noqa: E402
from glm53_ds.plan.activations import layer_kinds, profile_step, reduced_config  # noqa: E402
from glm53_ds.training.config import recompute_overrides  # noqa: E402
from tests.model_fixtures import CONFIG_A  # noqa: E402

KDA, DSA = "linear_attention", "indexed_attention"


def text_config(hidden: int, layers: int) -> dict:
    heads = max(2, hidden // 64)
    kinds = [KDA if i % 4 != 2 else DSA for i in range(layers)]
    return dict(CONFIG_A, num_hidden_layers=layers, layer_types=kinds, indexer_types=["full"] * layers,
                mlp_layer_types=["dense", "dense"] + ["sparse"] * (layers - 2), vocab_size=4096, hidden_size=hidden,
                intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2, num_attention_heads=heads,
                num_key_value_heads=heads, kv_lora_rank=hidden // 4, q_lora_rank=hidden // 2, qk_nope_head_dim=64,
                v_head_dim=64, index_head_dim=64, index_n_heads=4, linear_head_dim=64, linear_num_heads=heads,
                index_topk=256)  # fmt: skip


# each recompute mode, and full recompute with the long-row options (--offload-activations, --moe-tile-mib 1)
MODES = {"none": {}, "selective": {}, "full": {},
         "full+offload+tiles": {"offload_activations": True, "moe_tile_bytes": 2**20}}  # fmt: skip


def step_peak(cfg, tokens: int, mode: str, device: torch.device, dtype: torch.dtype, reduced: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(reduced_config(cfg) if reduced else cfg, dtype=dtype,
                            **recompute_overrides(mode.split("+")[0]), **MODES[mode])  # fmt: skip
    ids = torch.randint(1, cfg.vocab_size, (1, tokens), device=device)
    profile = profile_step(model, lambda: model(ids, labels=ids))
    allocator = None
    if device.type == "cuda" and not reduced:
        for p in model.parameters():
            p.grad = None
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(ids, labels=ids).backward()
        torch.cuda.synchronize()
        allocator = torch.cuda.max_memory_allocated() - start
    return profile, allocator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = glm53_ds.Glm53Config.from_text_dict(text_config(args.hidden, args.layers))
    rows, worst = [], 0.0
    for mode in MODES:
        reduced, _ = step_peak(cfg, args.tokens, mode, device, dtype, reduced=True)
        whole, allocator = step_peak(cfg, args.tokens, mode, device, dtype, reduced=False)
        predicted = reduced.peak(layer_kinds(cfg))
        row = dict(recompute=mode, predicted=predicted, tracker=whole.measured_peak, allocator=allocator)
        misses = [predicted / m - 1 for m in (whole.measured_peak, allocator) if m]
        worst = max(worst, *(abs(x) for x in misses))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("GLM53_BENCH_RESULTS", "benchmarks/results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"plan_check_{device.type}.json"), "w") as f:
        json.dump(dict(hidden=args.hidden, tokens=args.tokens, layers=args.layers, rows=rows), f)
    what = "tracker and allocator" if device.type == "cuda" else "tracker"
    print(
        f"plan_check {device.type}: hidden {args.hidden}, {args.tokens} tokens, {args.layers} layers: the "
        f"composed activation peak within {worst:.1%} of the whole step's ({what}), every recompute mode and full "
        "recompute with activation offload and MoE tiles"
    )


if __name__ == "__main__":
    main()
