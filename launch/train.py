"""Train or fine-tune GLM-5.3-Flash: `deepspeed launch/train.py [options]` (see --help).

With no arguments it trains the `tiny` preset on data/tiny_corpus.txt on CPU or GPU. The logic lives in
glm53_ds/training/.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53_ds.training.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
