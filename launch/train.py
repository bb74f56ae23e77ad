"""Train or fine-tune GLM-5.3-Flash: `deepspeed launch/train.py [options]` (see --help).

With no arguments it trains the `tiny` preset on data/tiny_corpus.txt on CPU or GPU. The logic lives in
glm53_ds/training/.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron-core announces on import that Transformer Engine / Apex are not installed; glm53_ds picks its kernels
# itself (glm53_ds/backends.py), so the five notices are noise before every run and before --help
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning
)
import torch  # noqa: E402

if (
    not torch.cuda.is_available()
):  # what DeepSpeed would detect, said up front (it warns when it has to guess)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from glm53_ds.training.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
