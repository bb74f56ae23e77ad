"""Know before you launch: one rank's memory at a layout (`python -m glm53_ds.plan`).

`counts.py` counts the parameters one rank holds exactly, from the model built on the meta device at the config
and layout; `state.py` turns them into the bytes of weights, gradients, fp32 masters and Adam moments as the engine
holds them; `activations.py` measures the activations per layer kind on a reduced model and composes them over the
model; `memory.py` adds the communication buffers, compares with a GPU and searches the layouts that fit.
`dry_run.py` runs the released model at a layout on meta tensors, forward and backward
(`python -m glm53_ds.plan.dry_run`).
"""

from .counts import ParameterCounts, count_parameters
from .state import StateBytes, state_bytes

__all__ = ["ParameterCounts", "StateBytes", "count_parameters", "state_bytes"]
