"""The GPU check's steps, their limits, and a summary that survives any of them (`benchmarks/gpu_check.sh` runs this).

Ordered by what a short device window is worth: imports (stop at once if the carried wheels are missing), a smoke
step that compiles and launches every kernel at the released width, the DSA kernel, the MoE grouped GEMM, fla's
KDA (bf16, autotuning bounded), the real-width step, a DeepSpeed training run of a real-width slice, then the rest.
Each step runs under its own time limit; its output streams as it runs; when it ends, one line gives its status
and the figures it wrote, and `summary.json` in the output folder is rewritten with every step so far (a step
killed at the window's end loses only itself). `--plan` lists the steps and their total (at most 540 s, so that
the install of the carried wheels, about 10 s for 25 MB, fits a 600 s call).

    python3 benchmarks/gpu_check.py --out DIR [--dry-run | --plan]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BUDGET_S = 540
FLA_CONFIGS = "4"  # autotuned configurations per fla kernel (benchmarks/fla_bounded.py)
DRY_SLOWER = 4  # the dry run's limits: a 2-core CPU in Triton's interpreter, at toy sizes

IMPORTS = """
import importlib, sys
dry = "--dry" in sys.argv
missing = []
for name in ("torch", "triton", "megatron.core", "deepspeed", "transformers", "fla"):
    try:
        module = importlib.import_module(name)
        print(f"import {name}: {getattr(module, '__version__', 'ok')}", flush=True)
    except Exception as e:
        print(f"import {name}: MISSING ({type(e).__name__}: {e})", flush=True)
        missing.append(name)
import torch
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA", flush=True)
fatal = [m for m in missing if not (dry and m == "fla")]  # the CPU dry run has no fla
sys.exit(3 if fatal else 0)
"""


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    device: list[str]
    dry: list[str] | None  # None: the same command
    fatal: bool = False  # a failure stops the check (nothing after it can run)

    def command(self, dry: bool, results: str) -> list[str]:
        argv = self.dry if dry and self.dry is not None else self.device
        return [a.replace("{results}", results) for a in argv]


TRAIN = ["-m", "deepspeed.launcher.runner", "--num_gpus", "1", "benchmarks/fla_bounded.py", "launch/train.py",
         "--deepspeed_config", "ds_configs/zero2_bf16.json", "--log-interval", "5", "--output-dir",
         "{results}/train"]  # fmt: skip

STEPS = [
    Step("imports", 20, [PY, "-c", IMPORTS], [PY, "-c", IMPORTS, "--dry"], fatal=True),
    Step("smoke", 30, [PY, "benchmarks/gpu_smoke.py"], [PY, "benchmarks/gpu_smoke.py", "--device", "cpu", "--small"]),
    Step("dsa_kernel", 115, [PY, "benchmarks/dsa_kernel.py", "--tokens", "16384", "32768"],
         [PY, "benchmarks/dsa_kernel.py", "--device", "cpu", "--small"]),
    Step("moe_experts", 40, [PY, "benchmarks/moe_experts.py", "--size", "real"],
         [PY, "benchmarks/moe_experts.py", "--experts", "8", "--repeats", "1"]),
    Step("kda", 45, [PY, "benchmarks/fla_bounded.py", "benchmarks/gpu_correctness.py", "--checks", "kda",
                     "--kda-dtypes", "bf16"],
         [PY, "benchmarks/gpu_correctness.py", "--device", "cpu", "--small", "--checks", "kda"]),
    Step("model_step", 60, [PY, "benchmarks/fla_bounded.py", "benchmarks/model_step.py", "--size", "real", "--seq",
                            "4096", "16384", "--dtype", "bf16"],
         [PY, "benchmarks/model_step.py", "--size", "tiny", "--seq", "128", "--repeats", "1"]),
    Step("train", 55, [PY, *TRAIN, "--model-config", "benchmarks/configs/real_slice.json", "--data", "data/tiny_corpus.txt", "--seq-length", "4096",
                       "--micro-batch-size", "1", "--train-iters", "20", "--lr", "1e-5", "--min-lr", "1e-6"],
         [PY, *TRAIN, "--train-iters", "3"]),
    Step("correctness", 30, [PY, "benchmarks/gpu_correctness.py", "--checks", "hc_post", "attention", "loss_head"],
         [PY, "benchmarks/gpu_correctness.py", "--device", "cpu", "--small", "--checks", "hc_post", "attention",
          "loss_head"]),
    Step("hc_post", 20, [PY, "benchmarks/hc_post.py", "--tokens", "16384", "--hidden", "4096", "--hc-mult", "4",
                         "--dtype", "bf16"],
         [PY, "benchmarks/hc_post.py", "--tokens", "256", "--hidden", "256", "--dtype", "bf16"]),
    Step("mhc_overhead", 20, [PY, "benchmarks/mhc_overhead.py", "--seq", "16384", "--hidden", "4096", "--layers", "4",
                              "--dtype", "bf16"],
         [PY, "benchmarks/mhc_overhead.py", "--seq", "128", "--hidden", "128", "--layers", "4"]),
    Step("head_memory", 20, [PY, "benchmarks/head_memory.py", "--tokens", "16384"],
         [PY, "benchmarks/head_memory.py", "--tokens", "512", "--repeats", "1"]),
    Step("plan_check", 25, [PY, "benchmarks/plan_check.py", "--device", "cuda", "--hidden", "1024", "--tokens", "4096"],
         [PY, "benchmarks/plan_check.py", "--hidden", "64", "--tokens", "256"]),
    # last: --compile is off by default until this measures it; its compiling time (inductor's Triton kernels for
    # every layer kind, forward and backward) is unknown on this image, and a cut step loses only itself
    Step("compile", 60, [PY, "benchmarks/fla_bounded.py", "benchmarks/model_step.py", "--size", "real", "--seq", "4096",
                         "--dtype", "bf16", "--compile", "--repeats", "2"],
         [PY, "benchmarks/model_step.py", "--size", "tiny", "--seq", "64", "--repeats", "1", "--compile",
          "--compile-backend", "aot_eager"]),
]  # fmt: skip


def plan() -> str:
    lines = [f"{i:>2}. {s.name:<13}{s.limit_s:>4} s  {' '.join(a if ' ' not in a else '...' for a in s.device[1:])[:90]}"
             for i, s in enumerate(STEPS)]  # fmt: skip
    return "\n".join(lines + [f"total {sum(s.limit_s for s in STEPS)} s"])


def _figures(path: str) -> Any:
    """What a result file holds worth the summary: its `summary` when it has one, else all of it."""
    try:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                records = [json.loads(line) for line in f if line.strip()]
            return {"records": len(records), "last": records[-1] if records else None,
                    "mean_tflops_per_gpu": _mean(records, "tflops_per_gpu"), "mean_mfu": _mean(records, "mfu"),
                    "mean_tokens_per_s": _mean(records, "tokens_per_s")}  # fmt: skip
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data.get("summary", data) if isinstance(data, dict) else data
    except (OSError, ValueError) as e:
        return {"unreadable": str(e)}


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [
        r[key] for r in records[len(records) // 2 :] if isinstance(r.get(key), int | float)
    ]  # the warm half
    return sum(values) / len(values) if values else None


def run(out: str, dry: bool, only: list[str] | None = None) -> int:
    results = os.environ.get("GLM53_BENCH_RESULTS") or os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(results, exist_ok=True)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": dry,
                               "budget_s": sum(s.limit_s for s in STEPS), "steps": {}}  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLM53_FLA_AUTOTUNE_CONFIGS": FLA_CONFIGS}
    code = 0
    for step in STEPS:
        if only and step.name not in only:
            continue
        begun, wall = time.time(), time.perf_counter()
        limit = step.limit_s * (DRY_SLOWER if dry else 1)
        print(f"=== {step.name} (limit {limit} s)", flush=True)
        try:
            rc = subprocess.run(step.command(dry, results), cwd=ROOT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        seconds = round(time.perf_counter() - wall, 1)
        written = sorted(p for p in glob.glob(os.path.join(results, "**", "*.json*"), recursive=True)
                         if os.path.getmtime(p) >= begun and "data_cache" not in p)  # fmt: skip
        figures = {os.path.relpath(p, results): _figures(p) for p in written}
        summary["steps"][step.name] = {
            "rc": rc,
            "seconds": seconds,
            "limit_s": step.limit_s,
            "results": figures,
        }
        with open(os.path.join(out, "summary.json.tmp"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=str)
        os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))
        status = "ok" if rc == 0 else f"FAILED (rc {rc})"
        print(
            f"=== {step.name}: {status} after {seconds} s; results: {', '.join(figures) or 'none'}",
            flush=True,
        )
        if rc != 0:
            code = 1
            if step.fatal:
                print(f"=== stopping: {step.name} failed, nothing after it can run", flush=True)
                return 2
    train = os.path.join(results, "train", "metrics.jsonl")
    if os.path.isfile(train):
        with open(train, encoding="utf-8") as src, open(os.path.join(out, "train_metrics.jsonl"), "w") as dst:
            dst.write(src.read())
    return code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where the summary goes (the device tool's $OUT)")
    p.add_argument("--dry-run", action="store_true", help="the same steps on CPU at toy sizes")
    p.add_argument("--plan", action="store_true", help="list the steps and their limits")
    p.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], help="only these steps")
    args = p.parse_args()
    if args.plan:
        print(plan())
        return 0
    if not args.out:
        p.error("--out is required")
    return run(args.out, args.dry_run, args.steps)


if __name__ == "__main__":
    sys.exit(main())
