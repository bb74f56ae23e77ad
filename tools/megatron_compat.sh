#!/usr/bin/env bash
# Check glm53_ds against another megatron-core release in a fresh Python 3.12 virtualenv beside the project.
#
#     tools/megatron_compat.sh 0.19.2          # megatron-core 0.17 and later need Python >= 3.12
#
# Builds <project>/../glm53_ds-megatron-<VERSION> (or $MEGATRON_COMPAT_VENV) with python3.12, installs that
# megatron-core and the project with what the tests import (torch from the package index is the multi-GB CUDA
# build; it runs on CPU), then runs the megatron-facing tests: the block specs and the stock GPTModel against our model and
# transformers, pg_collection and megatron's groups under sequence parallelism, loading released weights into a
# GPTModel, the layer stack, and the trainer's tiny run. It ends with pytest's summary line. CI runs 0.16.1 on
# Python 3.11 (README's second command); this is how another version is checked.
set -euo pipefail
version=${1:?usage: tools/megatron_compat.sh VERSION (e.g. 0.19.2)}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${MEGATRON_COMPAT_VENV:-$root/../glm53_ds-megatron-$version}
# python3.12 on PATH, else pyenv's (a pyenv shim exists without a selected 3.12)
python=${PYTHON312:-$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || pyenv prefix 3.12 2>/dev/null | sed 's|$|/bin/python3.12|' || true)}
[ -n "$python" ] && [ -x "$python" ] || { echo "error: no Python 3.12 found (megatron-core >= 0.17 needs it; set PYTHON312)" >&2; exit 2; }
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install -q --upgrade pip
# the project and what its tests import, without the [test] extra's triton pin: the CUDA torch wheel brings its own
# triton (torch 2.13.0: triton 3.7.1), and nothing checked here runs a Triton kernel
"$venv/bin/pip" install -q "megatron-core==$version" -e "$root" pytest==9.0.3 peft==0.21.2 safetensors==0.8.0
echo "install: $(( $(date +%s) - start )) s into $venv ($("$venv/bin/python" -c 'import megatron.core, torch; print("megatron-core", megatron.core.__version__, "torch", torch.__version__)'))"
cd "$root"
export PATH="$venv/bin:$PATH"  # the trainer test starts `deepspeed` by name
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_specs.py \
    tests/test_transformer_layer.py \
    tests/test_model.py \
    tests/test_hf_loader.py \
    tests/compat \
    "tests/parallel/test_sequence.py::test_sp_matches_one_process_per_module_and_model[sp2]" \
    tests/parallel/test_layout.py \
    "tests/training/test_trainer.py::test_readme_main_job_command_lowers_loss"
