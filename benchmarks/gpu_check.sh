#!/usr/bin/env bash
# The prepared GPU check, one call of the `device` tool on a lent GPU, inside its 10-minute limit:
#   1. correctness on CUDA: the fused Triton hc_post against the eager path and fp64, and fla-core's KDA kernel
#      against the torch path (forward and gradients, bf16 and fp32);
#   2. the fused DSA sparse-attention kernel at the released width (64 heads, latent 512, W = 2063): its
#      correctness vs the torch reference on CUDA (fp32, bf16, deterministic backward), then forward and backward
#      TFLOP/s and peak memory at 16k and 32k tokens vs dense causal SDPA (benchmarks/dsa_kernel.py);
#   3. benchmarks at real sizes (16k tokens, D=4096, hc_mult H=4): the routed experts as grouped GEMMs vs the
#      per-expert loop at the released width (36 local experts = 288 / EP 8, I 2048, bf16: TFLOP/s), hc_post, the
#      whole fwd+bwd step vs transformers on a real-width GLM-5.3 slice (with its host syncs), the mHC overhead;
#   4. a training run through the DeepSpeed launcher on the GPU (NCCL, bf16, ZeRO-2): the README job, 30 steps;
#   5. the activation planner vs the caching allocator's peak of real steps (benchmarks/plan_check.py);
#   6. sequence parallelism: sp_memory.py on CUDA (SP sizes up to the number of visible GPUs; one GPU measures the
#      SP = 1 baseline at 32k tokens, the ratios need more GPUs). Last, so that it is the step cut if time runs out.
# Each step has its own time limit; a failed or timed-out step is logged and the next one runs.
#
#   bash benchmarks/gpu_wheels.sh       # here, once: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   run(carry=[".whl"], timeout_s=600, command="bash benchmarks/gpu_check.sh")
#   bash benchmarks/gpu_check.sh --dry-run   # the same steps on CPU at toy sizes (Triton interpreter)
#
# The log and JSON files go to benchmarks/results/ (the dry run: a temporary folder) and, when set, to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
if [ "$dry" = 1 ]; then
  GLM53_BENCH_RESULTS=$(mktemp -d)
  export TRITON_INTERPRET=1 GLM53_BENCH_RESULTS
  results=$GLM53_BENCH_RESULTS
else
  results=benchmarks/results
  export DS_ACCELERATOR=cuda
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
  fi
fi
mkdir -p "$results"
log=$results/gpu_check.log

step() {  # step LIMIT_SECONDS COMMAND...
  local limit=$1 start=$SECONDS rc
  shift
  echo "=== $* (limit ${limit}s)"
  timeout "$limit" "$@"
  rc=$?
  echo "=== rc=$rc after $((SECONDS - start))s"
}

{
  date -u
  if [ "$dry" = 1 ]; then
    echo "dry run on CPU"
    step 300 python3 benchmarks/gpu_correctness.py --device cpu --small
    step 300 python3 benchmarks/dsa_kernel.py --device cpu --small
    step 120 python3 benchmarks/moe_experts.py --experts 8 --repeats 1
    step 120 python3 benchmarks/hc_post.py --tokens 256 --hidden 256 --dtype bf16
    step 120 python3 benchmarks/model_step.py --size tiny --seq 128 --repeats 1
    step 120 python3 benchmarks/mhc_overhead.py --seq 128 --hidden 128 --layers 4
    step 300 python3 benchmarks/head_memory.py --tokens 512 --repeats 1
    step 300 python3 -m deepspeed.launcher.runner --num_gpus 1 launch/train.py --train-iters 3 \
      --deepspeed_config ds_configs/zero2_bf16.json --output-dir "$results/train"
    step 120 python3 benchmarks/plan_check.py --hidden 64 --tokens 256
    step 300 python3 benchmarks/sp_memory.py --tokens 1024 --sp 1 2
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -c "from glm53_ds.backends import importable; print('fla available:', importable('fla.ops.kda'))"
    step 100 python3 benchmarks/gpu_correctness.py
    step 135 python3 benchmarks/dsa_kernel.py --tokens 16384 32768
    step 40 python3 benchmarks/moe_experts.py --size real
    step 35 python3 benchmarks/hc_post.py --tokens 4096 16384 --hidden 4096 --hc-mult 4 --dtype bf16 fp32
    step 75 python3 benchmarks/model_step.py --size real --seq 4096 16384 --dtype bf16
    step 45 python3 benchmarks/mhc_overhead.py --seq 16384 --hidden 4096 --layers 4 --dtype bf16
    step 35 python3 benchmarks/head_memory.py --tokens 16384
    step 70 python3 -m deepspeed.launcher.runner --num_gpus 1 launch/train.py --train-iters 30 \
      --deepspeed_config ds_configs/zero2_bf16.json --output-dir "$results/train"
    step 30 python3 benchmarks/plan_check.py --device cuda --hidden 1024 --tokens 4096
    step 35 python3 benchmarks/sp_memory.py --device cuda --tokens 32768
  fi
  date -u
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then
  cp "$results"/*.json "$log" "$OUT"/ 2>/dev/null
  cp "$results"/train/metrics.jsonl "$OUT"/train_metrics.jsonl 2>/dev/null
fi
echo "results in $results"
