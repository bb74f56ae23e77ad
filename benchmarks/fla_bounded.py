"""fla-core's KDA kernels with their autotuning bounded, for a GPU that is measured for minutes only.

fla-core 0.6.0 autotunes its KDA kernels over ~150-200 configurations per (dtype, head count) key: 2-5 minutes on
a cold machine before the first step. `limit_autotune(n)` keeps each autotuned kernel's first `n` configurations
(Triton's `Autotuner`, before fla is imported); the time of the first call (autotune + compile) is what a step
that includes it pays. Used by the GPU check; a training run on a machine of its own autotunes fully once.

    python3 benchmarks/fla_bounded.py SCRIPT [ARGS...]   # run SCRIPT (e.g. launch/train.py) with the bound
    GLM53_FLA_AUTOTUNE_CONFIGS=4                          # the bound (default 4)
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

DEFAULT_CONFIGS = 4


def limit_autotune(configs: int) -> None:
    """Every `triton.autotune` kernel created from now on tries at most its first `configs` configurations."""
    from triton.runtime import autotuner

    if getattr(autotuner.Autotuner, "_bounded_to", None) is not None:
        return
    original = autotuner.Autotuner.__init__

    def bounded(self: Any, fn: Any, arg_names: Any, configs_: list, *args: Any, **kwargs: Any) -> None:
        original(self, fn, arg_names, list(configs_)[:configs], *args, **kwargs)

    autotuner.Autotuner.__init__ = bounded
    autotuner.Autotuner._bounded_to = configs  # type: ignore[attr-defined]


if __name__ == "__main__":
    limit_autotune(int(os.environ.get("GLM53_FLA_AUTOTUNE_CONFIGS", DEFAULT_CONFIGS)))
    args = sys.argv[1:]
    at = next(
        i for i, a in enumerate(args) if a.endswith(".py")
    )  # DeepSpeed's launcher puts --local_rank first
    script = args[at]
    sys.argv = [script, *args[:at], *args[at + 1 :]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
