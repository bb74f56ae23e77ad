"""`build_engine(model, ds_config)`: a GLM-5.3 model under a DeepSpeed engine, in one call.

The sequence (every step needed for correctness; docs/parallelism.md explains each):
    check_version()                            refuse a DeepSpeed the patches were not written for
    layout                                     the one the model was built under (world 1 set up if none)
    prepare_model(model, layout)               expert tags, MoE markers, replicated weights untagged
    register_expert_groups(layout)             megatron's EP / expert-DP groups as DeepSpeed's
    optimizer                                  AdamW over DeepSpeed's MoE parameter groups (or the caller's)
    bf16: Fp32Params(model)                    HF's fp32-kept parameters become fp32 buffers DeepSpeed never casts
    deepspeed.initialize(..., mpu=DeepSpeedMpu(layout))
    install_gradient_sync(engine, layout)      ETP pre-average of replicated gradients, global clipping norm
    bf16: install_fp32_params(engine, ...)     their world-mean reduction, global norm, clipping and fp32 optimizer
    install_update_skip(engine)                a requested skip (a batch without targets) down DeepSpeed's skip path
    install_step_guard(engine)                 a step whose global gradient norm is inf / NaN changes nothing and
                                               raises NonFiniteGradientError
Returns a `Glm53Engine` (handle.py): the DeepSpeed engine, the layout, the fp32-kept parameters, typed.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from ..compat.deepspeed_shm import register_cleanup
from ..layers.moe import Glm53MoE
from ..parallel.layout import ParallelLayout, init_layout
from ..parallel.params import is_expert_param
from ..parallel.rank_order import renumber_by_node
from ..parallel.state import default_backend, free_port
from .deepspeed_internals import (
    DeepSpeedMoEMarker,
    check_version,
    forget_deepspeed_groups,
    install_fp32_params,
    install_gradient_sync,
    install_step_guard,
    install_update_skip,
    load_cpu_adam_op,
    load_cpu_comm_op,
    register_expert_groups,
)
from .fp32_params import Fp32Params
from .handle import Glm53Engine
from .mpu import DeepSpeedMpu
from .nodes import apply_deepspeed_env, choose_socket_interfaces, may_span_nodes

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None

# AdamW as the trainer uses it (DeepSeek-V3 / GLM betas); the learning rate is set every step by the trainer.
ADAMW_DEFAULTS: dict[str, Any] = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

# the launcher's variables init_distributed set for a world of one (no launcher), removed by close_distributed
_LAUNCHER_VARIABLES_SET: list[str] = []


def init_distributed(timeout_s: float | None = None) -> None:
    """torch.distributed through DeepSpeed's launcher environment; a world of one when launched without it (or
    adopted from an existing world-1 process group, e.g. `glm53_ds.build_model`'s). `timeout_s`: how long a
    collective waits for a peer before it fails (`--dist-timeout`; None: DeepSpeed's default). Across nodes, each
    node's `.deepspeed_env` and the interface of its collectives first (engine/nodes.py), said by its local
    rank 0."""
    if dist.is_initialized():
        if dist.get_world_size() == 1:  # DeepSpeed's engine wants the launcher's variables
            for key in ("RANK", "LOCAL_RANK"):
                os.environ.setdefault(key, "0")
            os.environ.setdefault("WORLD_SIZE", "1")
    else:
        for key, value in (
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", None),
        ):
            if key not in os.environ:  # no launcher: a world of one, its variables removed again at close
                os.environ[key] = value or str(free_port())
                _LAUNCHER_VARIABLES_SET.append(key)
        if not torch.cuda.is_available():
            register_cleanup()
    several_nodes = may_span_nodes()
    if several_nodes:
        lines = [apply_deepspeed_env(), choose_socket_interfaces(torch.cuda.is_available())]
        if os.environ.get("LOCAL_RANK", "0") == "0":
            for line in filter(None, lines):
                print(line, file=sys.stderr, flush=True)
    load_cpu_comm_op()
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if (
        timeout is not None
    ):  # groups made later without a timeout (DeepSpeed's expert groups) get this one too
        set_default_group_timeout(timeout)
    try:
        if several_nodes and not dist.is_initialized():
            # the world first, as DeepSpeed would make it, then renumbered node by node where the launcher did not
            # (parallel/rank_order.py); DeepSpeed adopts the result
            kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
            if torch.cuda.is_available():  # as DeepSpeed's TorchBackend binds it
                kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(default_backend(), init_method="env://", **kwargs)
            renumbered = renumber_by_node(**kwargs)
            if renumbered and dist.get_rank() == 0:
                print(renumbered, file=sys.stderr, flush=True)
        deepspeed.init_distributed(
            dist_backend=default_backend(), verbose=False, **({"timeout": timeout} if timeout else {})
        )
    except RuntimeError as e:  # torch's DistNetworkError: the rendezvous port is taken (another job's)
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e):
            raise
        port = os.environ.get("MASTER_PORT", "?")
        raise OSError(
            f"--master_port {port}: the port is in use (EADDRINUSE) on {os.environ.get('MASTER_ADDR', '?')} (another "
            f"job on this machine?); give each job its own: deepspeed --master_port {int(port) + 1 if port.isdigit() else 29501} ... "
            "(docs/usage.md, 'Two jobs on one machine')"
        ) from None


def set_default_group_timeout(timeout: timedelta) -> None:
    """torch gives a process group made without a timeout its module default (30 minutes), not the world's: so a
    group made by a library (DeepSpeed's expert groups call `new_group(ranks)`) would wait 30 minutes on a frozen
    node whatever `--dist-timeout` says. The default itself is set (torch reads it at each `new_group`)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def close_distributed() -> None:
    """Destroy the process groups before the interpreter exits. Left to interpreter teardown, gloo's worker
    threads are sometimes destroyed while joinable and the process aborts ("terminate called without an active
    exception", exit status 250 through DeepSpeed's launcher) after the trainer has returned its own code."""
    forget_deepspeed_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    while _LAUNCHER_VARIABLES_SET:  # the next run in this process picks its own free port
        os.environ.pop(_LAUNCHER_VARIABLES_SET.pop(), None)


def prepare_model(model: nn.Module, layout: ParallelLayout) -> None:
    """Tag parameters as DeepSpeed expects and attach the MoE markers (idempotent).

    - Expert parameters (`allreduce = False`, set by the model) get `group_name = "ep_size_<EP>"` and, under
      ETP, `tensor_model_parallel = True`, so DeepSpeed's norms count each expert slice on its shard.
    - megatron marks its linear weights `tensor_model_parallel` even at TP = 1; attention runs with TP = 1 here,
      so those weights are replicas and must be reduced and counted as such.
    - DeepSpeed handles expert gradients only when it finds a module of its MoE type: a parameter-less marker
      (`deepspeed_internals.DeepSpeedMoEMarker`) is attached to each GLM MoE layer."""
    for p in model.parameters():
        if is_expert_param(p):
            p.group_name = layout.expert_group_name  # type: ignore[attr-defined]
            # an expert LoRA adapter whole on every ETP rank (layers/lora.py) is counted once, not per slice
            etp_whole = getattr(p, "etp_replicated", False)
            p.tensor_model_parallel = layout.etp > 1 and not etp_whole  # type: ignore[attr-defined]
        elif getattr(p, "tensor_model_parallel", False):
            p.tensor_model_parallel = False  # type: ignore[attr-defined]
    for module in model.modules():
        if isinstance(module, Glm53MoE) and not hasattr(module, "deepspeed_moe_marker"):
            module.deepspeed_moe_marker = DeepSpeedMoEMarker(
                module.router.num_experts, layout.ep, layout.expert_group_name
            )


def decays(name: str, param: torch.Tensor, no_decay_pattern: str | None = None) -> bool:
    """The weight-decay rule (Megatron's default): matrices decay; biases and 1-D parameters (norm weights, A_log,
    dt_bias, mHC base / scale, gate vectors) do not; nor does any name `no_decay_pattern` (a regex) matches."""
    if param.dim() < 2 or name.endswith(".bias"):
        return False
    return not (no_decay_pattern and re.search(no_decay_pattern, name))


def decay_groups(
    named: list[tuple[str, torch.Tensor]], no_decay_pattern: str | None = None
) -> list[dict[str, Any]]:
    """Decay / no-decay groups of `named` tensors: decay groups carry no `weight_decay` (the optimizer's own
    applies), no-decay groups `weight_decay = 0`; empty groups are left out."""
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if decays(n, p, no_decay_pattern)], "name": "decay"},
        {"params": [p for n, p in named if not decays(n, p, no_decay_pattern)], "weight_decay": 0.0, "name": "no_decay"},
    ]  # fmt: skip
    return [g for g in groups if g["params"]]


def optimizer_param_groups(model: nn.Module, no_decay_pattern: str | None = None) -> list[dict[str, Any]]:
    """Trainable parameters (frozen ones, e.g. the DSA indexer without its loss, stay out) in decay / no-decay
    groups (`decay_groups`), each split into DeepSpeed's MoE groups (ZeRO needs experts in groups of their own).
    Call after `prepare_model` (the split reads the expert tags)."""
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    split = split_params_into_different_moe_groups_for_optimizer(decay_groups(named, no_decay_pattern))
    return [g for g in split if g["params"]]


def describe_param_groups(
    engine: Glm53Engine, weight_decay: float, no_decay_pattern: str | None = None
) -> str:
    """One line for the start-up log: trained tensors (the fp32-kept ones of a bf16 engine included) with and
    without weight decay, and what is frozen, counted from the model (ZeRO flattens the optimizer's groups)."""
    model = engine.module
    named = engine.trained_parameters()
    decayed = [p for n, p in named if decays(n, p, no_decay_pattern)]
    spared = [p for n, p in named if not decays(n, p, no_decay_pattern)]
    frozen = [p for p in model.parameters() if not p.requires_grad]

    def count(ps: Sequence[torch.Tensor]) -> str:
        return f"{len(ps)} tensors ({sum(p.numel() for p in ps):,} parameters)"

    return (
        f"weight decay {weight_decay:g} on {count(decayed)}; none on {count(spared)}; frozen {count(frozen)}"
    )


def _optimizer_factory(
    optimizer: OptimizerArg, ds_config: dict[str, Any]
) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """How to build an optimizer of the engine's kind over given groups (also used for the fp32-kept parameters):
    the caller's factory, the type and defaults of the caller's optimizer, or AdamW (hyperparameters from the
    DeepSpeed config's `optimizer` section when it has one)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        kind, defaults = type(optimizer), dict(optimizer.defaults)
        return lambda groups: kind(groups, **defaults)
    if optimizer is not None:
        return optimizer
    section = ds_config.get("optimizer") or {}
    if section and str(section.get("type", "")).lower() not in ("adam", "adamw"):
        raise ValueError(
            f"build_engine: the DeepSpeed config's optimizer type {section.get('type')!r} is not supported "
            "(glm53_ds builds AdamW itself; pass optimizer= for another)"
        )
    params = {**ADAMW_DEFAULTS, **{k: v for k, v in section.get("params", {}).items() if k in ADAMW_DEFAULTS}}
    params["betas"] = tuple(params["betas"])
    return lambda groups: torch.optim.AdamW(groups, **params)


def _offloaded(
    factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """ZeRO-Offload's optimizer: DeepSpeedCPUAdam in AdamW mode with the hyperparameters `factory`'s AdamW has (its
    update on the host partition, vectorised; DeepSpeed refuses another optimizer there). Its op is built once per
    machine under a lock a killed builder releases (`load_cpu_adam_op`)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        probe = factory([{"params": [torch.zeros(1, requires_grad=True)]}])
        if not isinstance(probe, torch.optim.AdamW):
            raise ValueError(f"build_engine: --offload-optimizer cpu updates with DeepSpeedCPUAdam (AdamW); the "
                             f"optimizer given is {type(probe).__name__}")  # fmt: skip
        d = probe.defaults
        load_cpu_adam_op()
        return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                                adamw_mode=True)  # fmt: skip

    return build


def _check_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for i, group in enumerate(optimizer.param_groups):
        if len({is_expert_param(p) for p in group["params"]}) > 1:
            raise ValueError(
                f"build_engine: optimizer param group {i} mixes expert and non-expert parameters; pass a "
                "factory (optimizer=lambda groups: ...) to receive DeepSpeed's MoE groups"
            )
    return optimizer


def build_engine(
    model: nn.Module,
    ds_config: dict[str, Any],
    optimizer: OptimizerArg = None,
    layout: ParallelLayout | None = None,
    no_decay_pattern: str | None = None,
) -> Glm53Engine:
    """Wrap `model` (built under `layout`) in a DeepSpeed engine with every glm53_ds fix installed.

    `optimizer`: None for AdamW over DeepSpeed's MoE groups (hyperparameters from the config's `optimizer`
    section when it has one), an optimizer whose groups already separate experts, or a factory that receives
    the groups (`optimizer_param_groups`: decay / no-decay by `decays`, plus `no_decay_pattern`, MoE-split). `layout`: the one the model was built under; None for a single process (world 1 is set up
    when no process group exists). Returns the `Glm53Engine` handle."""
    check_version()
    if layout is None:
        init_distributed()
        config: Any = getattr(model, "config", None)
        ep = getattr(config, "expert_model_parallel_size", 1) or 1
        etp = getattr(config, "expert_tensor_parallel_size", 1) or 1
        if dist.get_world_size() > 1 or ep * etp > 1:
            raise ValueError(
                f"build_engine: world size {dist.get_world_size()}, EP={ep}, ETP={etp}: pass the layout the model "
                "was built under (glm53_ds.parallel.init_layout)"
            )
        layout = init_layout(1, 1)
    prepare_model(model, layout)
    register_expert_groups(layout)
    config = {k: v for k, v in ds_config.items() if k != "optimizer"}  # the optimizer is built here
    factory = _optimizer_factory(optimizer, ds_config)
    low_precision = bool(config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled"))
    side = Fp32Params(model) if low_precision else None  # before DeepSpeed's cast and flat buffers
    # ZeRO-Offload as training/run_plan.optimizer_offload reads it (the engine imports nothing of the trainer's)
    offload = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device") == "cpu"
    opt = (
        _check_optimizer(optimizer)
        if isinstance(optimizer, torch.optim.Optimizer)
        else (_offloaded(factory) if offload else factory)(optimizer_param_groups(model, no_decay_pattern))
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=config, mpu=DeepSpeedMpu(layout)
    )
    synced = install_gradient_sync(engine, layout)
    kept = side if side is not None and len(side) else None
    if kept is not None:
        kept.finish(factory, lambda named: decay_groups(named, no_decay_pattern))
        install_fp32_params(engine, kept, layout)
    install_update_skip(engine)
    install_step_guard(engine)
    return Glm53Engine(engine, layout, fp32_params=kept, gradient_sync=synced)
