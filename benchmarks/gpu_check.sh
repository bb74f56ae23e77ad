#!/usr/bin/env bash
# The GPU check: one call of at most 600 s on one lent GPU, which cannot lose what it measured.
#
#   bash benchmarks/gpu_wheels.sh        # here, once: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   then, on the GPU machine, with .whl carried:  bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --plan      # the steps and their limits (total <= 540 s)
#   bash benchmarks/gpu_check.sh --dry-run [--steps NAME ...]   # the same code path on CPU at toy sizes
#
# Everything printed goes to $OUT/gpu_check.log from the first line ($OUT: the device tool's folder; a temporary one
# when unset). The steps (benchmarks/gpu_check.py) run in the order of what they are worth, each under its own
# limit; after each, one line with its status and figures, and $OUT/summary.json rewritten with every step so far.
# $OUT ends with at most three files: gpu_check.log, summary.json, train_metrics.jsonl. The device run's JSON files
# also land in benchmarks/results/ (commit them); the dry run's in a temporary folder.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
if [ "$mode" = "--plan" ]; then
  exec python3 benchmarks/gpu_check.py --plan
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), output in $OUT"
if [ "$mode" = "--dry-run" ]; then
  GLM53_BENCH_RESULTS=$(mktemp -d)
  export TRITON_INTERPRET=1 GLM53_BENCH_RESULTS DS_ACCELERATOR=cpu
  shift
  python3 benchmarks/gpu_check.py --out "$OUT" --dry-run "$@"  # e.g. --steps imports smoke train
  rc=$?
else
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: .whl/ holds no wheels: run 'bash benchmarks/gpu_wheels.sh' here and carry .whl (megatron-core," \
      "deepspeed, transformers and fla-core are not on the GPU image); stopping before any step"
    exit 2
  fi
  started=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "error: installing the carried wheels failed"; exit 2; }
  export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH" DS_ACCELERATOR=cuda
  echo "installed the carried wheels in $((SECONDS - started)) s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 benchmarks/gpu_check.py --out "$OUT"
  rc=$?
fi
echo "gpu_check finished (rc $rc) $(date -u '+%H:%M:%S UTC'); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
