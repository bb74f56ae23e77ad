"""Test-session setup.

Without a GPU the Triton kernels run in Triton's interpreter, which `triton.jit` picks at decoration time, so
the variable is set here, before any test imports the kernel module.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests on this 2-core machine: avoid oversubscription from intra-op threads in multi-process tests.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny released-layout checkpoints of CONFIG_A: full-scale weights, and 0.3x matrices (where bf16 tracks
    fp32 and a few optimizer steps stay within fp32's rounding): the multi-rank tests' starting points."""
    from tests.model_fixtures import CONFIG_A, save_tiny_hf

    full = tmp_path_factory.mktemp("ep_full")
    calm = tmp_path_factory.mktemp("ep_calm")
    save_tiny_hf(full, CONFIG_A)
    save_tiny_hf(calm, CONFIG_A, matrix_scale=0.3)
    return str(full), str(calm)
