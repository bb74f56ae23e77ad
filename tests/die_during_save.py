"""`launch/train.py` with a fault for the tests: the save of tag `--die-during-save TAG` dies (exit 17) after its
replicated files are written and before the expert shards and `latest`, as a killed job would; with
`GLM53_TEST_DIE=node` the rank takes its whole process group with it (SIGKILL: on a fake node, its launcher and
every rank: the node is gone). The rest of argv is the trainer's command line. Run through the DeepSpeed launcher
like launch/train.py."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53_ds.engine import checkpoint  # noqa: E402
from glm53_ds.training.main import main  # noqa: E402

_at = sys.argv.index("--die-during-save")
TAG = sys.argv[_at + 1]
del sys.argv[_at : _at + 2]
_write_set = checkpoint._write_set


def _dying_write_set(root, set_name, state, names):  # type: ignore[no-untyped-def]
    tag_dir = os.path.basename(os.path.dirname(root))  # root is <save>/<tag being written>/glm53
    if set_name.startswith("experts_") and (tag_dir == TAG or tag_dir.startswith(f".{TAG}.tmp-")):
        if os.environ.get("GLM53_TEST_DIE") == "node":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(17)
    return _write_set(root, set_name, state, names)


checkpoint._write_set = _dying_write_set

if __name__ == "__main__":
    sys.exit(main())
