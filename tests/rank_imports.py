"""What every test process imports, imported once by the fork server they are forked from
(tests/forked_processes.py). Quietly: the import-time notices (Apex / Transformer Engine missing, DeepSpeed's
accelerator guess) would otherwise print once per test session from the server, about no test."""

import os
import warnings

import torch

# in the server only (each process takes the test's environment): DeepSpeed need not guess, nor say it did
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import deepspeed  # noqa: F401
    import megatron.core  # noqa: F401
    import transformers  # noqa: F401

    import glm53_ds.engine  # noqa: F401
    import glm53_ds.model  # noqa: F401
    import glm53_ds.training.trainer  # noqa: F401
    import tests.model_fixtures  # noqa: F401
