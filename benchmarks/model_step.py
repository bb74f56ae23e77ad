"""Forward+backward of glm53_ds vs the transformers reference on the same tiny config and weights.

For each sequence length: tokens/s and peak extra memory of one fwd+bwd step (loss on all tokens), both models
in one run, reported as ratios ours/HF. Peak memory: CUDA allocator peak on GPU, live tensor bytes on CPU.

    python3 benchmarks/model_step.py [--seq 512 2048] [--batch 1] [--dtype fp32|bf16]

Last line: `model_step time_ratio_vs_hf=<ours/HF> mem_ratio_vs_hf=<ours/HF>` at the longest sequence.
JSON goes to benchmarks/results/model_step_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from benchmarks.measure import device_description, peak_extra_bytes, print_table, time_call, write_results  # noqa: E402
from tests.model_fixtures import CONFIG_A, load_hf_reference, save_tiny_hf  # noqa: E402

BENCH_CONFIG = dict(CONFIG_A, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, index_topk=64,
                    index_kpool=16, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4)  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf(tmp, BENCH_CONFIG)
        hf = load_hf_reference(tmp, dtype=dtype).to(device).train()
        ours = glm53_ds.load_hf(tmp, dtype=dtype).to(device).train()

    rows = []
    for seq in args.seq:
        ids = torch.randint(1, BENCH_CONFIG["vocab_size"], (args.batch, seq), device=device)
        steps = {
            "hf": lambda ids=ids: hf(input_ids=ids, labels=ids).loss.backward(),
            "glm53_ds": lambda ids=ids: ours(ids, labels=ids).backward(),
        }
        for name, step in steps.items():
            seconds = time_call(step, device, warmup=1, repeats=args.repeats)
            params = [p for p in (hf if name == "hf" else ours).parameters()]
            peak = peak_extra_bytes(step, params)
            rows.append(dict(model=name, seq=seq, batch=args.batch, dtype=args.dtype, step_s=seconds,
                             tokens_per_s=args.batch * seq / seconds, peak_MiB=peak / 2**20))  # fmt: skip
    print(f"device: {device_description(device)}")
    print_table(rows, ["model", "seq", "batch", "dtype", "step_s", "tokens_per_s", "peak_MiB"])
    longest = max(args.seq)
    by = {r["model"]: r for r in rows if r["seq"] == longest}
    summary = dict(
        seq=longest,
        time_ratio_vs_hf=by["glm53_ds"]["step_s"] / by["hf"]["step_s"],
        mem_ratio_vs_hf=by["glm53_ds"]["peak_MiB"] / by["hf"]["peak_MiB"],
    )
    path = write_results(
        f"model_step_{device.type}", dict(device=device_description(device), rows=rows, summary=summary)
    )
    print(f"results: {path}")
    print(
        f"model_step time_ratio_vs_hf={summary['time_ratio_vs_hf']:.3f} mem_ratio_vs_hf={summary['mem_ratio_vs_hf']:.3f}"
    )


if __name__ == "__main__":
    main()
