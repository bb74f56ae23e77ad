"""What a run resolves before its model is built, and how set-up failures are agreed over the ranks.

- `model_config`: the model the run builds, with the run's MTP choices;
- `gradient_accumulation`, `deepspeed_config`, `RunPlan`: the global batch, accumulation steps and DeepSpeed's
  config, resolved once from the `TrainConfig` and the world size (checked against a given --deepspeed_config);
- `default_deepspeed_config`, `zero_stage_and_bf16`: the config without --deepspeed_config (the planner's too);
- `or_setup_error`, `agreed`: a set-up step's OSError / ValueError as one `SetupError`, on one rank or agreed by all;
  `report_error`: one `error:` line per failure, not one per rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import Glm53Config
from .config import SetupError, TrainConfig
from .model_source import resolve_model
from .option_checks import check_optimizer_offload


def agreed(fn: Any) -> Any:
    """Run a set-up step on every rank and agree on its outcome: when any rank fails, every rank raises the same
    `SetupError` (the first failing rank's message, naming that rank), so that it is reported once and no rank
    waits for another that has left. Only for steps without collectives of their own."""
    try:
        result, failure = fn(), None
    except (OSError, ValueError) as e:  # SetupError is a ValueError
        result, failure = None, str(e)
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    found = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if found:
        rank, message = found[0]
        error = SetupError(message + (f" (found on rank {rank})" if dist.get_world_size() > 1 else ""))
        error.agreed = True  # type: ignore[attr-defined]
        raise error
    return result


def model_config(config: TrainConfig) -> Glm53Config:
    """The model the run builds (`resolve_model`: --hf-dir, --model-config, --load's own, or tiny), with the run's
    MTP choices."""
    cfg, _ = resolve_model(config.hf_dir, config.model_config, config.load, config.load_tag)
    if config.mtp_loss_weight is not None:
        cfg = cfg.replace(mtp_loss_weight=config.mtp_loss_weight)
    if config.no_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    return cfg


def gradient_accumulation(config: TrainConfig, world: int, global_batch: int) -> int:
    """Micro-batches per step: global batch = micro batch x (world / SP) x GAS (an SP group reads one set)."""
    data_world = world // config.sp
    per_step = config.micro_batch_size * data_world
    if global_batch % per_step:
        readers = f"world size {world}" if config.sp == 1 else f"(world size {world} / --sp {config.sp})"
        given = "--global-batch-size" if config.global_batch_size else "the checkpoint's global batch"
        raise SetupError(
            f"{given} {global_batch} is not a multiple of --micro-batch-size {config.micro_batch_size} "
            f"x {readers} = {per_step}"
        )
    return global_batch // per_step


def default_deepspeed_config(on_gpu: bool) -> dict[str, Any]:
    """DeepSpeed's config without --deepspeed_config: ZeRO 2 in bf16 on GPUs, stage 0 in fp32 on CPU."""
    return {"zero_optimization": {"stage": 2 if on_gpu else 0, "contiguous_gradients": True, "overlap_comm": on_gpu},
            "bf16": {"enabled": on_gpu}}  # fmt: skip


def zero_stage_and_bf16(ds: dict[str, Any]) -> tuple[int, bool]:
    """A DeepSpeed config's ZeRO stage and whether it trains in bf16."""
    return int(ds.get("zero_optimization", {}).get("stage", 0)), bool(
        ds.get("bf16", {}).get("enabled", False)
    )


def deepspeed_config(config: TrainConfig, world: int, gas: int) -> dict[str, Any]:
    """DeepSpeed's config: the --deepspeed_config file (checked against the command line) or a default."""
    # DeepSpeed's data-parallel size: ETP is its model-parallel group, SP its sequence-parallel group
    ds_dp = world // (config.etp * config.sp)
    wanted = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "train_batch_size": config.micro_batch_size * gas * ds_dp,
        "gradient_clipping": config.clip_grad,
    }
    if config.deepspeed_config:
        try:
            with open(config.deepspeed_config, encoding="utf-8") as f:
                ds = json.load(f)
        except json.JSONDecodeError as e:
            raise SetupError(
                f"--deepspeed_config {config.deepspeed_config}:{e.lineno}: not valid JSON ({e.msg})"
            ) from e
        for section, instead in (
            ("optimizer", "--lr / --weight-decay"),
            ("scheduler", "--lr / --min-lr / --warmup"),
        ):
            if section in ds:
                raise SetupError(
                    f"--deepspeed_config {config.deepspeed_config}: has a section '{section}'; the trainer builds it "
                    f"from {instead} (remove the section)"
                )
        for key, value in wanted.items():
            if key in ds and ds[key] != "auto" and ds[key] != value:
                raise SetupError(
                    f"--deepspeed_config {config.deepspeed_config}: {key}={ds[key]} contradicts the command line, "
                    f"which gives {key}={value} (--micro-batch-size {config.micro_batch_size}, --global-batch-size "
                    f"{config.global_batch_size or config.micro_batch_size * world}, world size {world}, "
                    f"ETP {config.etp}, --clip-grad {config.clip_grad})"
                )
    else:
        ds = default_deepspeed_config(on_gpu=torch.cuda.is_available())
    ds.update(wanted)
    apply_optimizer_offload(ds, config.offload_optimizer, config.deepspeed_config)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def optimizer_offload(ds: dict[str, Any]) -> str:
    """Where a DeepSpeed config keeps the optimizer state: "cpu" (ZeRO-Offload) or "none"."""
    section = ds.get("zero_optimization", {}).get("offload_optimizer") or {}
    return str(section.get("device") or "none").lower()


def apply_optimizer_offload(ds: dict[str, Any], offload: str, path: str | None) -> None:
    """--offload-optimizer into DeepSpeed's config (ZeRO-Offload: `zero_optimization.offload_optimizer`), pinned
    host buffers on a GPU. Refused: ZeRO 0 (nothing partitioned to offload; DeepSpeed would ignore it), a config
    file that offloads otherwise than the flag says (one source for it), NVMe (not supported here)."""
    named = f"--deepspeed_config {path}: " if path else ""
    in_file = optimizer_offload(ds)
    if in_file not in ("none", "cpu"):
        raise SetupError(f"{named}offload_optimizer.device {in_file!r}: glm53_ds offloads to the host only "
                         "(--offload-optimizer cpu)")  # fmt: skip
    if in_file == "cpu" and offload != "cpu":
        raise SetupError(f"{named}offload_optimizer.device is 'cpu' but --offload-optimizer is {offload!r}; say it "
                         "with --offload-optimizer cpu (the run records it, the planner counts it)")  # fmt: skip
    if offload == "none":
        return
    check_optimizer_offload(offload, zero_stage_and_bf16(ds)[0], named or "the default config: ")
    zero = ds.setdefault("zero_optimization", {})
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}


def or_setup_error(fn: Any, alike: bool = False) -> Any:
    """`fn()`, its OSError / ValueError as a `SetupError`; `alike`: a collective step whose failure every rank
    raises together (reported once)."""
    try:
        return fn()
    except (OSError, ValueError) as e:
        error = SetupError(str(e))
        error.agreed = alike  # type: ignore[attr-defined]
        raise error from e


@dataclass(frozen=True)
class RunPlan:
    """The run-level values, resolved once from the TrainConfig and the world size (before any model is built)."""

    world: int
    global_batch: int  # sequences per optimizer step
    gas: int  # micro-batches per step on each rank
    data_world: int  # sample readers: world / SP (an SP group reads one set of rows)
    ds_config: dict[str, Any]

    @classmethod
    def resolve(cls, config: TrainConfig, world: int, saved_batch: int | None) -> RunPlan:
        """The global batch (given, the --load checkpoint's, or micro x readers), GAS and DeepSpeed's config;
        SetupError naming the option when they do not fit."""
        data_world = world // config.sp
        global_batch = config.global_batch_size or saved_batch or config.micro_batch_size * data_world
        gas = gradient_accumulation(config, world, global_batch)
        return cls(world, global_batch, gas, data_world, deepspeed_config(config, world, gas))

    @property
    def zero_stage(self) -> int:
        return zero_stage_and_bf16(self.ds_config)[0]

    @property
    def bf16(self) -> bool:
        return zero_stage_and_bf16(self.ds_config)[1]

    def samples_per_step(self, micro_batch_size: int) -> int:
        return micro_batch_size * self.gas * self.data_world


def report_error(error: Exception, lead: str = "") -> None:
    """One `error:` line per failure, not one per rank: a failure every rank finds alike (before the process group
    exists: every rank of a node reads the same files; after it: `agreed` steps and training stops) is printed by
    rank 0 (local rank 0 before the group exists); one that a rank found alone is printed by it, naming it."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        alike = getattr(error, "agreed", False)  # TrainingStopped: True unless a rank alone found it
    else:
        rank, world, alike = int(os.environ.get("LOCAL_RANK", "0")), 1, True
    if not alike or rank == 0:
        where = f"rank {rank}: " if not alike and world > 1 else ""
        print(f"{lead}error: {where}{error}", file=sys.stderr, flush=True)
    if (
        alike and world > 1
    ):  # no rank leaves before rank 0 has said it (the launcher kills the rest at the first exit)
        dist.barrier()
    elif alike and rank != 0:  # before the process group: local rank 0 says it; a moment for it to
        time.sleep(2)
