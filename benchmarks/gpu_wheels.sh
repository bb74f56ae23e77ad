#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels the lent GPU machine lacks, into .whl/ (git-ignored) for the device
# tool to carry. That machine has no network and its own Python 3.12 + torch + triton image (KINDS.md lists its
# packages): it lacks megatron-core, deepspeed (and pydantic/hjson), fla-core and transformers >= 5.23 (glm5_next).
# Versions are this project's pins (requirements-ci.txt) where it has them; the rest are the versions CI runs with.
# About 25 MB in all; the device tool carries at most 64 MiB per call with the working tree.
#   bash benchmarks/gpu_wheels.sh            # then: run(carry=[".whl"], command="bash benchmarks/gpu_check.sh")
# megatron-core: 0.16.1 by default (what CI tests on CPU); MEGATRON_CORE=0.19.2 carries that release instead (the
# image's Python 3.12 takes either; tools/megatron_compat.sh checks 0.19.2 on CPU).
set -euo pipefail
megatron_core=${MEGATRON_CORE:-0.16.1}
cd "$(dirname "$0")/.."
dest=.whl
rm -rf "$dest"
mkdir -p "$dest"
platform=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" \
  "megatron-core==$megatron_core" transformers==5.23.0 fla-core==0.6.0 \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  typing-extensions==4.16.0 hjson==3.1.0 regex==2026.5.9
# DeepSpeed publishes only a source distribution: build its pure-Python wheel (no ops compiled; the project passes
# torch optimizers, so no JIT-built op is needed), recorded as a CUDA build.
python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest/src" deepspeed==0.19.8
DS_ACCELERATOR=cuda DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" \
  "$dest"/src/deepspeed-0.19.8.tar.gz
rm -rf "$dest/src"
ls -la "$dest"
du -sh "$dest"
