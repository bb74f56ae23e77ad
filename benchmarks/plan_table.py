"""The released model's memory table for docs/usage.md, from the planner (`glm53_ds.plan.memory.search`).

    python benchmarks/plan_table.py [--lengths 8192,32768,131072] [--lora-rank 16] [--runs full,lora]

For full fine-tuning and LoRA, at each length, on H200 (141 GB) and H100 (80 GB): the smallest world (GPUs) at
which some layout fits, and that layout (the cheapest: least recompute, SP and ETP). One markdown row each; the
last line is the summary.
"""

from __future__ import annotations

import argparse
import time
import warnings

from glm53_ds.plan.memory import search
from glm53_ds.plan.run import PlannedRun
from glm53_ds.plan.state import GiB
from glm53_ds.training.presets import preset

GPUS = {"H200": 141 * 10**9, "H100-80GB": 80 * 10**9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--runs", default="full,lora", help="which runs: full (full SFT), lora, or both")
    p.add_argument("--gpus", default=",".join(GPUS), help=f"which GPUs of {', '.join(GPUS)}")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    cfg = preset("glm-5.3-flash")
    start, rows = time.process_time(), 0
    print("| run | tokens | GPU | smallest world | layout | per rank (state + activations + buffers) |")
    print("|---|---|---|---|---|---|")
    runs = {"full": 0, "lora": args.lora_rank}
    for lora in (runs[r] for r in args.runs.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            for gpu_name in args.gpus.split(","):
                gpu = GPUS[gpu_name]
                found = search(
                    PlannedRun.for_model(
                        cfg, seq_length=length, micro_batch_size=1, lora_rank=lora, gpu_memory=f"{gpu}B"
                    )
                )
                world, fitting = found.world, found.fitting
                run = f"LoRA r={lora}" if lora else "full SFT"
                if not fitting:
                    print(f"| {run} | {length:,} | {gpu_name} | > 1024 | — | — |", flush=True)
                    continue
                m = fitting[0]
                lay = m.run.config
                print(f"| {run} | {length:,} | {gpu_name} | {world} | EP {lay.ep} × ETP {lay.etp} × SP {lay.sp}, "
                      f"ZeRO {m.run.zero}, recompute {lay.recompute}{' + activation offload' if lay.offload_activations else ''} | {m.total / GiB:.1f} GiB ({m.state.total / GiB:.0f}"
                      f" + {m.activations / GiB:.0f} + {m.communication / GiB:.1f}) |", flush=True)  # fmt: skip
                rows += 1
    print(f"plan_table: {rows} rows, {time.process_time() - start:.0f} s CPU")


if __name__ == "__main__":
    main()
