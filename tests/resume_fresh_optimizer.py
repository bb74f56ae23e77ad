"""`launch/train.py` with the control of tests/engine/test_checkpoint.py: a resume at another layout that takes the
model, step, data position and RNG from the checkpoint but starts the optimizer state fresh (Adam moments zero,
masters from the weights). The rest of argv is the trainer's command line; run through the DeepSpeed launcher."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53_ds.engine import checkpoint  # noqa: E402
from glm53_ds.training.main import main  # noqa: E402


def _fresh_optimizer(engine, ckpt, places, saved_dtypes):  # type: ignore[no-untyped-def]
    for access in checkpoint._optimizers(checkpoint._trained(engine)):
        access.prepare(ckpt.optimizer_step)


checkpoint._load_portable_optimizer = _fresh_optimizer

if __name__ == "__main__":
    sys.exit(main())
