"""`launch/train.py` with a fault for the tests, as a killed job would meet it:

- `--die-during-save TAG`: the save of tag TAG dies (exit 17) after its replicated files are written and before
  the expert shards and `latest`; with `GLM53_TEST_DIE=rank` by SIGKILL (kill -9), with `GLM53_TEST_DIE=node`
  the rank takes its whole process group with it (SIGKILL: on a fake node, its launcher and every rank: the node
  is gone);
- `--die-in-host-update STEP` (ZeRO-Offload): each rank SIGKILLs itself inside optimizer step STEP, after
  DeepSpeedCPUAdam has updated the host's masters and moments and before the device weights take them.

The rest of argv is the trainer's command line. Run through the DeepSpeed launcher like launch/train.py."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53_ds.engine import checkpoint  # noqa: E402
from glm53_ds.training.main import main  # noqa: E402


def _option(flag: str) -> str | None:
    if flag not in sys.argv:
        return None
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at : at + 2]
    return value


TAG = _option("--die-during-save")
HOST_UPDATE = _option("--die-in-host-update")
_write_set = checkpoint._write_set


def _dying_write_set(root, set_name, state, names):  # type: ignore[no-untyped-def]
    tag_dir = os.path.basename(os.path.dirname(root))  # root is <save>/<tag being written>/glm53
    if set_name.startswith("experts_") and (tag_dir == TAG or tag_dir.startswith(f".{TAG}.tmp-")):
        if os.environ.get("GLM53_TEST_DIE") == "node":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if os.environ.get("GLM53_TEST_DIE") == "rank":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(17)
    return _write_set(root, set_name, state, names)


if TAG is not None:
    checkpoint._write_set = _dying_write_set
if HOST_UPDATE is not None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    _host_step = DeepSpeedCPUAdam.step

    def _dying_host_step(self, closure=None):  # type: ignore[no-untyped-def]
        out = _host_step(self, closure)
        if max((int(s.get("step", 0)) for s in self.state.values()), default=0) == int(HOST_UPDATE):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    DeepSpeedCPUAdam.step = _dying_host_step

if __name__ == "__main__":
    sys.exit(main())
