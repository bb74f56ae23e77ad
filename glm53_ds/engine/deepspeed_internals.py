"""Every use of DeepSpeed's private internals, in one place, for the one supported version range.

glm53_ds needs DeepSpeed to do four things it has no public API for (docs/parallelism.md explains each):
  1. use megatron's EP and expert-data-parallel groups (its own `groups` module would build different ones);
  2. enable its MoE paths without its MoE layer (a parameter-less marker of its `MoE` type);
  3. reduce replicated gradients over every replica (the gradient-sync patch: pre-average over ETP) and clip by
     the norm of the global-batch gradient;
  4. keep HF's fp32-kept parameters out of its bf16 cast (`fp32_params.py`) yet in its global norm and step, load
     checkpoints whose model files glm53_ds writes itself, and load its pickled files without running code
     (`weights_only_loads`);
  5. read and write the optimizer state of one parameter whatever optimizer holds it (`ParamOptimizerState`),
     for checkpoints that resume at another layout.
`PATCHED_SYMBOLS` lists every private symbol touched here; `docs/parallelism.md` carries the same table and
`tests/engine/test_build.py` keeps the two equal and checks that no other module touches these symbols.
`check_version()` refuses a DeepSpeed outside `SUPPORTED` before anything is patched.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import (
    groups,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from deepspeed.utils.tensor_fragment import fragment_address
from packaging.version import Version
from torch import nn

from ..parallel.grad_norm import clip_grad_norm, global_grad_norm
from ..parallel.layout import ParallelLayout
from ..parallel.params import is_expert_param, is_sharded_param
from .fp32_params import Fp32Params

# [low, high): the versions these patches were written against
SUPPORTED = (Version("0.19.8"), Version("0.20.0"))
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch: weights_only even where False is passed
FORCE_NO_WEIGHTS_ONLY = (
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch: never weights_only (ignored for checkpoints)
)


@dataclass(frozen=True)
class PatchedSymbol:
    symbol: str
    how: str  # read | written | called | replaced | wrapped | subclassed | toggled | allowlisted
    why: str


PATCHED_SYMBOLS = (
    PatchedSymbol("deepspeed.utils.groups._EXPERT_PARALLEL_GROUP", "written",
                  "megatron's EP group registered under `ep_size_<EP>`"),
    PatchedSymbol("deepspeed.utils.groups._EXPERT_PARALLEL_GROUP_RANKS", "written", "its ranks"),
    PatchedSymbol("deepspeed.utils.groups._EXPERT_DATA_PARALLEL_GROUP", "written",
                  "megatron's expert-data-parallel group: ZeRO partitions expert parameters over it"),
    PatchedSymbol("deepspeed.utils.groups._EXPERT_DATA_PARALLEL_GROUP_RANKS", "written", "its ranks"),
    PatchedSymbol("deepspeed.utils.groups.mpu", "written",
                  "set to None when the world closes: the engine registered glm53_ds's mpu there, which holds every group"),
    PatchedSymbol("deepspeed.moe.layer.MoE", "subclassed",
                  "a parameter-less marker (its `__init__` skipped) that turns on the engine's MoE paths"),
    PatchedSymbol("DeepSpeedEngine._reduce_non_expert_gradients", "wrapped",
                  "stage 0 / BF16_Optimizer: replicated gradients pre-averaged over ETP first"),
    PatchedSymbol("DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads", "wrapped",
                  "ZeRO-1/2: the same, per parameter, on every path (overlap_comm, accumulation)"),
    PatchedSymbol("DeepSpeedEngine.clip_fp32_gradients", "replaced",
                  "stage 0 fp32: clip by the global-batch norm, not a DP average of per-rank norms"),
    PatchedSymbol("DeepSpeedEngine._global_grad_norm", "written",
                  "the norm the replacement computed (also without clipping, by the plain optimizer's step guard)"),
    PatchedSymbol("DeepSpeedZeroOptimizer.scaled_global_norm", "wrapped",
                  "ZeRO-1/2: a non-finite global norm raises before any update (bf16 applied it); bf16: the fp32-kept parameters' gradients join the norm once; a requested skip sets `overflow`"),
    PatchedSymbol("BF16_Optimizer.get_grads_for_norm", "wrapped",
                  "ETP ranks > 0 hold no replicated gradient to count: a zero placeholder; bf16: the fp32-kept parameters' norm; a requested skip: an inf"),
    PatchedSymbol("DeepSpeedEngine.checkpoint_engine", "wrapped",
                  "while saving: its `save` of the model-states file skipped on all but one rank per ETP rank (its MoE save lets every SP rank of the first replica write that one file)"),
    PatchedSymbol("DeepSpeedEngine._get_ckpt_name", "called", "the model-states file's path"),
    PatchedSymbol("DeepSpeedEngine.has_moe_layers", "toggled",
                  "off while DeepSpeed loads a checkpoint: the model files are glm53_ds's own"),
    PatchedSymbol("DeepSpeedEngine.step", "wrapped",
                  "bf16: at the boundary, reduce / clip / update HF's fp32-kept parameters (fp32_params.py) too; always: a step not applied (non-finite norm) raises, unless its skip was requested"),
    PatchedSymbol("FP16_UnfusedOptimizer.unscale_and_clip_grads", "wrapped",
                  "bf16 stage 0: the same, for its clipping"),
    PatchedSymbol("FP16_UnfusedOptimizer._global_grad_norm", "written", "the norm with them, as reported"),
    PatchedSymbol("deepspeed.runtime.fp16.loss_scaler.LossScaler", "allowlisted",
                  "plain data in ZeRO optimizer files: may be unpickled by weights_only loads"),
    PatchedSymbol("deepspeed.runtime.zero.config.ZeroStageEnum", "allowlisted", "an enum in ZeRO optimizer files"),
    PatchedSymbol("deepspeed.utils.tensor_fragment.fragment_address", "allowlisted",
                  "a dataclass in ZeRO / BF16_Optimizer files"),
    PatchedSymbol("DeepSpeedZeroOptimizer.optimizer", "read",
                  "layout-free optimizer state: the base optimizer's `step` and flat Adam state (also BF16_Optimizer)"),
    PatchedSymbol("DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state", "called",
                  "after a layout change: link each parameter's fragments to the Adam state made for it (also BF16_Optimizer)"),
    PatchedSymbol("DeepSpeedZeroOptimizer._hp_optimizer_states_linked", "written", "reset so that the link above runs"),
    PatchedSymbol("deepspeed.utils.tensor_fragment.tensor_fragment.lp_fragment_address", "read",
                  "a parameter's `_hp_mapping`: the part of its state this rank holds, so that a load reads only that"),
    PatchedSymbol("DeepSpeedZeroOptimizer.overflow", "written",
                  "a requested skip (a global batch without targets): set during the norm, the step's overflow branch discards it"),
    PatchedSymbol("FP16_UnfusedOptimizer.overflow_checker", "wrapped",
                  "stage-0 bf16: its check reports an overflow for a requested skip"),
    PatchedSymbol("FP16_UnfusedOptimizer.fp16_groups", "read", "stage-0 bf16: parameter -> its fp32 copy"),
    PatchedSymbol("FP16_UnfusedOptimizer.fp32_groups", "read", "the fp32 copies (the masters)"),
    PatchedSymbol("deepspeed.comm.torch.build_shm_op", "called",
                  "CPU: the shared-memory op JIT-loaded before DeepSpeed's own call, under a lock a killed rank releases (DeepSpeed keeps it loaded: its call builds nothing)"),
)  # fmt: skip


def check_version(version: str | None = None) -> None:
    """Refuse a DeepSpeed these patches were not written for, naming the versions."""
    found = Version(version or deepspeed.__version__)
    low, high = SUPPORTED
    if not low <= found < high:
        raise RuntimeError(
            f"glm53_ds patches DeepSpeed internals written for deepspeed >={low},<{high}; found {found} "
            f"(pip install deepspeed=={low})"
        )


# ----------------------------------------------------------------------------- 1. expert groups
def register_expert_groups(layout: ParallelLayout) -> None:
    """megatron's EP / expert-DP groups as DeepSpeed's `ep_size_<EP>` groups (before the engine is built)."""
    name = layout.expert_group_name
    groups._EXPERT_PARALLEL_GROUP[name] = layout.ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(layout.ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = layout.expert_dp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(layout.expert_dp_group)


def forget_deepspeed_groups() -> None:
    """Drop what DeepSpeed's group registry holds of this world (it is being closed): the groups
    `register_expert_groups` gave it and the mpu the engine registered (which holds the layout, so every group).
    Held there, they and their gloo threads (about 50 per engine on CPU) would outlive the world."""
    for registry in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                     groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):  # fmt: skip
        registry.clear()
    groups.mpu = None


# ----------------------------------------------------------------------------- 2. the MoE marker
class DeepSpeedMoEMarker(MoE):
    """Tells the DeepSpeed engine that the model has MoE layers; holds nothing and never runs.

    Its process groups are the ones `register_expert_groups` registered; DeepSpeed must not create its own."""

    def __init__(self, num_experts: int, ep_size: int, group_name: str) -> None:
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = group_name

    def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the DeepSpeed MoE marker is not a layer")


# ----------------------------------------------------------------------------- 3. gradient sync and norm
def _pre_average(tensors: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(size)


class NonFiniteGradientError(FloatingPointError):
    """The global gradient norm of an optimizer step is not finite (inf / NaN): the step's update was not applied to
    any parameter, on any rank (the norm is the same everywhere). After it the engine's gradient buffers are left
    as they are; load a checkpoint to go on."""

    def __init__(self, norm: float) -> None:
        super().__init__(f"the global gradient norm is {norm}; the update was not applied")
        self.norm = norm


def _refuse_non_finite(norm: Any) -> None:
    """Raise before any parameter changes when the step's global gradient norm is inf / NaN (or DeepSpeed's -1
    sentinel for one). One host read of the norm, which the step makes anyway."""
    value = float(norm)
    if not math.isfinite(value) or value < 0:
        raise NonFiniteGradientError(value)


def _install_norm_fixes(engine: Any, layout: ParallelLayout) -> None:
    """Clipping must use the norm of the global-batch gradient.

    - stage 0 with a plain optimizer: DeepSpeed's `clip_grad_norm_` averages per-rank norms over its data-parallel
      group, which is not the global norm once experts are split over EP; replaced by `grad_norm.clip_grad_norm`
      (replicated parameters once, expert shards summed over EP x ETP).
    - BF16_Optimizer: on ETP ranks other than 0 it has no replicated gradient to count and stacks an empty list;
      a zero placeholder keeps its (otherwise correct) computation going.
    ZeRO-1/2 compute the global norm correctly once expert shards carry `tensor_model_parallel` (see
    `build.prepare_model`); tests/engine/test_gradient_sync.py checks every mode.
    """
    optimizer = engine.optimizer
    expert_group, etp_rank = layout.pg_collection.tp_ep, dist.get_rank(layout.etp_group)
    zero = hasattr(optimizer, "reduce_independent_p_g_buckets_and_remove_grads")
    if not hasattr(optimizer, "get_grads_for_norm") and not zero:
        if not (engine.fp16_enabled() or engine.bfloat16_enabled()):  # a plain torch optimizer, ours

            def clip_fp32_gradients() -> None:
                engine._global_grad_norm = clip_grad_norm(
                    engine.module, engine.gradient_clipping(), expert_group, etp_rank
                )

            engine.clip_fp32_gradients = clip_fp32_gradients
    if isinstance(optimizer, torch.optim.Optimizer) and not (
        engine.fp16_enabled() or engine.bfloat16_enabled()
    ):
        plain_step = optimizer.step

        def step_if_finite(*args: Any, **kwargs: Any) -> Any:
            # DeepSpeed applies this optimizer whatever the norm: refused here when it is not finite. Without
            # clipping DeepSpeed computes no norm: computed here (and reported) instead.
            if engine.gradient_clipping() <= 0:
                engine._global_grad_norm = global_grad_norm(engine.module, expert_group, etp_rank)
            _refuse_non_finite(engine._global_grad_norm)
            return plain_step(*args, **kwargs)

        optimizer.step = step_if_finite  # type: ignore[method-assign]
    if zero:  # ZeRO-1/2 skip a non-finite norm themselves, but apply it in bf16 with check_grad_overflow off
        zero_norm = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> Any:
            norm = zero_norm(norm_type)
            _refuse_non_finite(norm)
            return norm

        optimizer.scaled_global_norm = scaled_global_norm
    if hasattr(optimizer, "get_grads_for_norm"):
        original = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            result = original(for_clipping=for_clipping)
            if not for_clipping and isinstance(result, tuple) and not result[0]:
                device = next(engine.module.parameters()).device
                result[0].append(torch.zeros(1, dtype=torch.float32, device=device))
            return result

        optimizer.get_grads_for_norm = get_grads_for_norm


# DeepSpeed engines the patch is on (held weakly: no attribute of ours on DeepSpeed's object)
_SYNCED: weakref.WeakSet[Any] = weakref.WeakSet()


def install_gradient_sync(engine: Any, layout: ParallelLayout) -> bool:
    """The gradient-sync patch on a built engine; returns True when the ETP pre-averaging was needed.

    Every replicated parameter's reduced gradient must be the mean over all its replicas (the world). DeepSpeed
    averages over its data-parallel group, which leaves out the ETP peers; each non-expert gradient is therefore
    pre-averaged over ETP right before DeepSpeed's own reduction:
        g <- all_reduce(g, ETP) / ETP;   DeepSpeed: g <- all_reduce(g, DP) / DP        => mean over DP x ETP
    Both are linear and idempotent on ETP-equal values, so it is correct at every call site and with gradient
    accumulation. Expert and tensor-parallel-sharded parameters are never touched. The clipping-norm fixes are
    installed in every layout."""
    if engine in _SYNCED:
        raise RuntimeError("the gradient-sync patch is already installed on this engine")
    _SYNCED.add(engine)
    _install_norm_fixes(engine, layout)
    if layout.etp == 1:
        return False
    group, size = layout.etp_group, layout.etp
    optimizer = engine.optimizer
    if hasattr(optimizer, "reduce_independent_p_g_buckets_and_remove_grads"):  # ZeRO-1/2
        original = optimizer.reduce_independent_p_g_buckets_and_remove_grads

        def reduce_param(param: torch.Tensor, i: int) -> Any:
            if param.grad is not None and not is_expert_param(param) and not is_sharded_param(param):
                _pre_average([param.grad.data], group, size)
            return original(param, i)

        optimizer.reduce_independent_p_g_buckets_and_remove_grads = reduce_param
    else:  # stage 0 and BF16_Optimizer
        original_reduce = engine._reduce_non_expert_gradients

        def reduce_non_expert(grads: list[torch.Tensor], elements_per_buffer: int) -> Any:
            _pre_average(grads, group, size)
            return original_reduce(grads, elements_per_buffer)

        engine._reduce_non_expert_gradients = reduce_non_expert
    return True


# DeepSpeed engines whose next accumulation boundary applies nothing (`skip_next_update`), held weakly
_SKIPPING: weakref.WeakSet[Any] = weakref.WeakSet()


def skip_next_update(engine: Any) -> None:
    """The engine's next boundary `step()` applies nothing: no parameter, no optimizer state (Adam moments, step
    count, weight decay) and no fp32-kept parameter changes, and its gradients are discarded; for a global batch
    that holds no target tokens. DeepSpeed's own skip path is taken (the one a non-finite norm takes in each
    optimizer), so its bookkeeping stays its own; `install_update_skip` opens that path on demand."""
    _SKIPPING.add(engine)


def install_update_skip(engine: Any) -> None:
    """Per optimizer kind, the hook that sends a requested skip down DeepSpeed's invalid-norm path: a plain torch
    optimizer (stage 0 fp32) is not called; ZeRO-1/2 see `overflow` set while they compute the norm; BF16_Optimizer
    gets an inf among its norm's gradients; the stage-0 bf16 optimizer's overflow check reports one. Installed
    after the norm fixes (outermost)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "reduce_independent_p_g_buckets_and_remove_grads"):  # ZeRO-1/2
        zero_norm = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> Any:
            norm = zero_norm(norm_type)
            if engine in _SKIPPING:
                optimizer.overflow = True  # step() takes its overflow branch right after the norm
            return norm

        optimizer.scaled_global_norm = scaled_global_norm
    elif hasattr(optimizer, "get_grads_for_norm"):  # BF16_Optimizer
        grads_for_norm = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            result = grads_for_norm(for_clipping=for_clipping)
            if engine in _SKIPPING and not for_clipping:
                device = next(engine.module.parameters()).device
                result[0].append(torch.full((1,), float("inf"), device=device))
            return result

        optimizer.get_grads_for_norm = get_grads_for_norm
    elif hasattr(optimizer, "overflow_checker"):  # FP16_UnfusedOptimizer (stage-0 bf16)
        checker = optimizer.overflow_checker
        check = checker.check

        def overflow_check(*args: Any, **kwargs: Any) -> Any:
            return True if engine in _SKIPPING else check(*args, **kwargs)

        checker.check = overflow_check
    elif isinstance(optimizer, torch.optim.Optimizer):  # a plain optimizer (stage 0 fp32)
        plain_step = optimizer.step

        def step_unless_skipped(*args: Any, **kwargs: Any) -> Any:
            return None if engine in _SKIPPING else plain_step(*args, **kwargs)

        optimizer.step = step_unless_skipped  # type: ignore[method-assign]
    else:
        raise TypeError(f"glm53_ds cannot skip an update of {type(optimizer).__name__}")


def install_step_guard(engine: Any) -> None:
    """`engine.step()` at an accumulation boundary raises `NonFiniteGradientError` whenever the update was not applied
    because the global gradient norm was not finite: where glm53_ds's hooks refuse it (above) and where DeepSpeed
    skips it itself (BF16_Optimizer, the stage-0 bf16 optimizer, ZeRO fp32), so that no caller goes on as if the
    step had been taken. Installed last, around every other wrapper of `step`."""
    original_step = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        try:
            result = original_step(*args, **kwargs)
        finally:
            skipped = boundary and engine in _SKIPPING
            if boundary:
                _SKIPPING.discard(engine)
        if (
            boundary and not engine.was_step_applied() and not skipped
        ):  # no loss scaling: only an invalid norm
            norm = engine.get_global_grad_norm()
            raise NonFiniteGradientError(float("nan") if norm is None else float(norm))
        return result

    engine.step = step


# ----------------------------------------------------------------------------- 4. checkpoints and fp32 masters
@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every `torch.load` inside reads tensors and plain data only, also DeepSpeed's own, which passes
    `weights_only=False` (TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides it; a TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD in the
    environment is lifted meanwhile): a pickled object that would run code is
    refused with one message naming the file, and nothing from it runs."""
    previous = {name: os.environ.get(name) for name in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    # the opposite switch in the user's environment would make torch refuse every load (both set): checkpoints are
    # read safely regardless, and the switch is restored afterwards
    os.environ.pop(FORCE_NO_WEIGHTS_ONLY, None)
    try:
        # the only classes DeepSpeed 0.19 writes into its files besides tensors and containers: plain data
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    except pickle.UnpicklingError as e:
        raise ValueError(f"refused to load a checkpoint file holding pickled objects other than tensors and plain "
                         f"data (nothing from it was run): {str(e).splitlines()[0]}") from e  # fmt: skip
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def one_model_states_writer(engine: Any, layout: ParallelLayout, save_dir: str, tag: str) -> Iterator[None]:
    """While DeepSpeed saves `<save_dir>/<tag>`: its model-states file (`mp_rank_<ETP rank>_model_states.pt`)
    written by one rank per ETP rank, the first of its data-parallel group (SP ranks included). DeepSpeed's MoE save
    writes it on every rank of data-parallel rank 0, and its data-parallel group (the mpu's, without SP ranks) gives
    rank 0 to every SP rank of the first replica: at SP > 1 several ranks would write one file at once, an
    unreadable mixture of their archives (seen: a two-node run's checkpoint that no resume could open). Every other
    file DeepSpeed writes is left as it is."""
    path = engine._get_ckpt_name(save_dir, tag)
    # the first of its DP group is also DP rank 0 without SP ranks: a rank DeepSpeed lets write it
    writes = layout.rank == layout.dp_ranks[0]
    writer = engine.checkpoint_engine
    save = writer.save

    def save_unless_the_model_states(state: Any, target: str) -> Any:
        if target == path and not writes:
            return None
        return save(state, target)

    writer.save = save_unless_the_model_states
    try:
        yield
    finally:
        del writer.save  # the class's own again


@contextmanager
def moe_checkpoint_files_off(engine: Any) -> Iterator[None]:
    """While DeepSpeed loads a checkpoint: it would look for its own per-expert model files, which glm53_ds does
    not write (the model comes from glm53_ds's files)."""
    has_moe = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = has_moe


def install_fp32_params(engine: Any, side: Fp32Params, layout: ParallelLayout) -> None:
    """Drive `side` (HF's fp32-kept parameters, outside DeepSpeed) with the engine's optimizer step: reduce their
    gradients and keep their squared norm before DeepSpeed computes its global norm (which the hooks below extend
    by it, once), then clip them by the same coefficient and update them when DeepSpeed's step was applied."""
    optimizer = engine.optimizer
    if engine.fp16_enabled():
        raise ValueError("glm53_ds keeps HF's fp32 parameters out of DeepSpeed's cast under bf16; fp16 (loss "
                         "scaling) is not supported: use bf16")  # fmt: skip
    original_step = engine.step
    side.sequence_parallel = layout.sp

    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            side.reduce()
        try:
            result = original_step(*args, **kwargs)
            if boundary and engine.was_step_applied():
                norm = engine.get_global_grad_norm()
                side.clip_and_step(float(norm) if norm is not None else 0.0, engine.gradient_clipping())
        finally:
            if boundary:
                side.zero_grad()
        return result

    engine.step = step
    if hasattr(optimizer, "scaled_global_norm"):  # ZeRO-1/2
        original_norm = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> Any:
            norm = original_norm(norm_type)
            extra = side.square_norm
            if extra is None or float(norm) < 0:  # no side gradients, or DeepSpeed's invalid-norm sentinel
                return norm
            norm = torch.as_tensor(norm, dtype=torch.float32)
            norm = torch.sqrt(norm.square() + extra.to(norm.device) * float(optimizer.loss_scale) ** 2)
            _refuse_non_finite(norm)  # the fp32-kept parameters' share may be the non-finite one
            return norm

        optimizer.scaled_global_norm = scaled_global_norm
    elif hasattr(optimizer, "get_grads_for_norm"):  # BF16_Optimizer
        original_grads = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            result = original_grads(for_clipping=for_clipping)
            if not for_clipping and side.square_norm is not None and layout.etp_rank == 0:
                # counted once, as BF16_Optimizer counts replicated gradients: on model-parallel rank 0
                device = next(engine.module.parameters()).device
                result[0].append(side.square_norm.sqrt().reshape(1).to(device))
            return result

        optimizer.get_grads_for_norm = get_grads_for_norm
    elif hasattr(optimizer, "unscale_and_clip_grads"):  # stage-0 bf16 optimizer
        original_clip = optimizer.unscale_and_clip_grads

        def unscale_and_clip_grads(total_norm: Any, apply_scale: bool = True) -> Any:
            if side.square_norm is not None:
                total_norm = math.sqrt(float(total_norm) ** 2 + float(side.square_norm))
                optimizer._global_grad_norm = total_norm
                _refuse_non_finite(total_norm)
            return original_clip(total_norm, apply_scale)

        optimizer.unscale_and_clip_grads = unscale_and_clip_grads


# ----------------------------------------------------------------------------- 5. per-parameter optimizer state
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class ParamOptimizerState:
    """Read and write one parameter's Adam state (fp32 master, `exp_avg`, `exp_avg_sq`) and the step count, whatever
    holds it: a plain torch optimizer (stage 0 fp32), DeepSpeed's ZeRO-1/2 or BF16_Optimizer (flat fp32
    partitions, reached through DeepSpeed's public `safe_get_full_*` / `safe_set_full_*` and the parameters' hp
    mapping) or the stage-0 bf16 optimizer (`FP16_UnfusedOptimizer`: an fp32 copy per parameter). The layout-free
    checkpoint state of `checkpoint.py` goes through here.

    `get` is collective under ZeRO (it all-reduces the parameter's fragments over the parameter's data-parallel
    group): every rank calls it for the same parameters in the same order. `set` is local."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        opt = self.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            self.kind = "partitioned"  # ZeRO-1/2, BF16_Optimizer
            inner = opt.optimizer
            if all(flat in inner.state for g in inner.param_groups for flat in g["params"]):
                # DeepSpeed 0.19.8's ZeRO links every parameter's fragments to the Adam state right after the first
                # parameter group's first step, when the other groups have none yet: their fragments stay empty.
                # Linked again here, now that every group has its state.
                self._relink()
        elif hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
            self.kind = "fp32_copies"
            self._copy = {
                id(p): c
                for ps, cs in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
                for p, c in zip(ps, cs, strict=True)
            }
        elif isinstance(opt, torch.optim.Optimizer):
            self.kind = "plain"
        else:
            raise ValueError(
                f"optimizer {type(opt).__name__}: glm53_ds cannot read its state per parameter (supported: a torch "
                "optimizer at stage 0, ZeRO-1/2, BF16_Optimizer, the stage-0 bf16 optimizer)"
            )

    def _inner(self) -> torch.optim.Optimizer:
        return self.optimizer if self.kind == "plain" else self.optimizer.optimizer

    def step(self) -> int:
        """Optimizer steps taken (the largest Adam `step` held; 0 before the first)."""
        steps = [float(s["step"]) for s in self._inner().state.values() if "step" in s]
        return int(max(steps)) if steps else 0

    def get(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """fp32 {"master", "exp_avg", "exp_avg_sq"} of the whole parameter (zeros before the first step), on the
        parameter's device: only the rank that writes a tensor copies it to the host."""
        if self.kind == "partitioned":
            if not self._inner().state:  # no step yet: nothing linked
                zeros = torch.zeros_like(param, dtype=torch.float32)
                return {"master": param.detach().float(), **{k: zeros for k in ADAM_MOMENTS}}
            out = {"master": safe_get_full_fp32_param(param)}
            for key in ADAM_MOMENTS:
                out[key] = safe_get_full_optimizer_state(param, key)
            return {k: v.detach().float() for k, v in out.items()}
        holder = self._copy[id(param)] if self.kind == "fp32_copies" else param
        state = self._inner().state.get(holder, {})
        out = {"master": holder.detach().float()}
        for key in ADAM_MOMENTS:
            out[key] = state[key].detach().float() if key in state else torch.zeros_like(out["master"])
        return out

    def fragment(self, param: torch.Tensor) -> tuple[int, int] | None:
        """(start, numel): the part of the flattened parameter whose fp32 master and moments this rank holds, when
        it holds a part (ZeRO-1/2, BF16_Optimizer; numel 0 for none); None when it holds them whole."""
        if self.kind != "partitioned":
            return None
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return 0, 0
        address = mapping.lp_fragment_address
        return int(address.start), int(address.numel)

    def prepare(self, step: int) -> None:
        """Before `set`: give every parameter an Adam state at `step` (DeepSpeed creates it lazily at the first
        step, and ZeRO links each parameter's fragments to it only then)."""
        inner = self._inner()
        for group in inner.param_groups:
            for flat in group["params"]:
                state = inner.state[flat]
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
                for key in ADAM_MOMENTS:
                    state[key] = torch.zeros_like(flat, dtype=torch.float32)
        if self.kind == "partitioned":
            self._relink()

    def _relink(self) -> None:
        self.optimizer._hp_optimizer_states_linked = False
        self.optimizer._lazy_init_hp_params_optimizer_state()

    def set(self, param: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Write a parameter's fp32 master and moments, whole-shaped; only the `fragment` part is read where there
        is one. The parameter takes `values["weight"]` (its value in its own dtype, possibly the parameter itself)
        when given, else the master."""
        master = values["master"]
        with torch.no_grad():
            param.copy_(values.get("weight", master).to(param.device, param.dtype))
        if self.kind == "partitioned":
            safe_set_full_fp32_param(param, master.to(param.device))
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(param, values[key].to(param.device), key)
            return
        holder = self._copy[id(param)] if self.kind == "fp32_copies" else param
        with torch.no_grad():
            holder.copy_(master.to(holder.device, holder.dtype))
        state = self._inner().state[holder]
        for key in ADAM_MOMENTS:
            state[key].copy_(values[key].to(holder.device))


# ----------------------------------------------------------------------------- CPU: the shared-memory comm op
def extensions_dir() -> str:
    """Where DeepSpeed's JIT ops are built unless TORCH_EXTENSIONS_DIR says: torch's default
    (`~/.cache/torch_extensions/py311_cpu`) is one directory for every environment of a Python version, so two
    virtualenvs (or nodes with another torch or DeepSpeed on a shared home) rebuild the op over each other's build,
    each run waiting minutes; here the directory is keyed by interpreter, torch and DeepSpeed."""
    import hashlib
    import sys

    env = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    key = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-deepspeed{deepspeed.__version__}-{env}"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_extensions", re.sub(r"[^\w.+-]", "_", key))


def _load_op_once(builder_name: str, load: Any, first_build: str) -> None:
    """Run `load()` (which JIT-builds DeepSpeed's op `builder_name` if needed) holding a kernel `flock` on
    `<build dir>/glm53_ds.lock`, the build said in one line by each machine's local rank 0 (`first_build`: its
    expected time).

    DeepSpeed JIT-builds its ops through torch's `FileBaton`: every load creates `<build dir>/lock`, runs ninja (a
    no-op once built) and removes it. A process killed in that window (a peer's failure, a scheduler's SIGKILL, the
    stop watchdog) leaves the file behind, and every later run on the machine then waits for it forever at start-up,
    silently. The kernel releases the `flock` when its holder dies; so a `lock` found while holding it was left by a
    killed process: it is removed, said in one line. The build directory is keyed by the environment
    (`extensions_dir`), so two environments never rebuild each other's op."""
    import fcntl
    import sys

    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    build_dir = _get_build_directory(builder.name, verbose=False)
    os.makedirs(build_dir, exist_ok=True)
    says = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one line per machine, not one per rank
    with open(os.path.join(build_dir, "glm53_ds.lock"), "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds or loads it now: say why this run waits
            if says:
                print(f"waiting for another process's build of DeepSpeed's {builder.name} op ({build_dir}; a first "
                      f"build takes {first_build})", file=sys.stderr, flush=True)  # fmt: skip
            fcntl.flock(guard, fcntl.LOCK_EX)
        if says and not any(f.endswith(".so") for f in os.listdir(build_dir)):
            print(f"building DeepSpeed's {builder.name} op, once per machine ({first_build}; kept in {build_dir})",
                  file=sys.stderr, flush=True)  # fmt: skip
        baton = os.path.join(build_dir, "lock")
        if os.path.exists(baton):
            os.unlink(baton)
            print(f"note: removed {baton}, a build lock left by a killed run (it would have made this run wait "
                  "for it forever)", file=sys.stderr)  # fmt: skip
        load()


def load_cpu_comm_op() -> None:
    """Load DeepSpeed's CPU shared-memory allreduce op before `deepspeed.init_distributed` does (no-op where the
    accelerator has no such op: CUDA), under `_load_op_once`'s lock. DeepSpeed caches the loaded op per process, so
    its own call builds nothing."""
    import importlib

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is torch itself
    _load_op_once("ShareMemCommBuilder", ds_comm_torch.build_shm_op, "1-2.5 min")


def load_cpu_adam_op() -> None:
    """Load DeepSpeedCPUAdam's op (ZeRO-Offload's host update) under `_load_op_once`'s lock, before the optimizer
    loads it (the op builder caches the loaded module: its own load builds nothing)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    _load_op_once("CPUAdamBuilder", lambda: CPUAdamBuilder().load(), "2-3 min")
