"""Test-session setup.

Without a GPU the Triton kernels run in Triton's interpreter, which `triton.jit` picks at decoration time, so
the variable is set here, before any test imports the kernel module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests on this 2-core machine: avoid oversubscription from intra-op threads in multi-process tests.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
