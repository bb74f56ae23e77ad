#!/usr/bin/env bash
# The prepared GPU check (run through the `device` tool on a lent GPU, inside ~10 minutes):
#   1. correctness of the fused Triton hc_post and of fla's KDA kernel against the torch paths on CUDA;
#   2. benchmarks at real sizes: hc_post (16k tokens, D=4096, H=4), mHC overhead, whole step vs HF.
# Results (JSON + this log) go to benchmarks/results/ and, when set, to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
log=benchmarks/results/gpu_check.log
mkdir -p benchmarks/results
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 180 python3 benchmarks/gpu_correctness.py
  timeout 120 python3 benchmarks/hc_post.py --tokens 4096 16384 --hidden 4096 --hc-mult 4 --dtype bf16 fp32
  timeout 120 python3 benchmarks/mhc_overhead.py --seq 4096 --hidden 1024 --layers 4
  timeout 120 python3 benchmarks/model_step.py --seq 512 2048 --dtype bf16
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*.json "$log" "$OUT"/ 2>/dev/null || true; fi
