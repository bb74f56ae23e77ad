#!/usr/bin/env bash
# The sm_90 compile check (benchmarks/sm90_compile.py) under Triton 3.6, the version the lent GPU image runs, installed
# beside the pinned 3.9 in a folder of its own (.triton36/, git-ignored; about 170 MB, once). Arguments pass through:
#   bash benchmarks/sm90_compile_triton36.sh [--json] [--dtypes bf16]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${TRITON36_DIR:-.triton36}
if [ ! -d "$dest/triton" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$dest" triton==3.6.0
fi
PYTHONPATH="$PWD/$dest:$PWD" python3 benchmarks/sm90_compile.py "$@"
