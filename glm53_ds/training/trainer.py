"""The training loop behind `deepspeed launch/train.py`.

Set-up validates everything that can be wrong before any training work (data, tokenizer, checkpoint dirs,
parallel layout, batch sizes vs the DeepSpeed config, token ids vs vocab) and fails with one message. Then:
process groups (EP x ETP) -> model with local experts (from --hf-dir: each rank reads only its tensors) ->
DeepSpeed engine + gradient-sync patch -> steps (warmup + cosine LR, router-bias update, metrics) ->
checkpoints (parallel/checkpoint.py) -> optional HF export and the loss-curve PNG.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import Glm53Config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(REPO_ROOT, "data", "tiny_corpus.txt")


class SetupError(ValueError):
    """A problem found before training starts; the message names the option and values."""


class TrainingStopped(RuntimeError):
    pass


# ----------------------------------------------------------------------------- configuration
def preset_name(args: Any) -> str | None:
    """The preset the run builds, or None when the model comes from --hf-dir or a config file."""
    from .presets import PRESETS

    if args.hf_dir or (args.model_config and args.model_config not in PRESETS):
        return None
    return args.model_config or "tiny"


def router_bias_update_rate(args: Any) -> float:
    from .presets import DEFAULT_ROUTER_BIAS_UPDATE_RATE, PRESET_ROUTER_BIAS_UPDATE_RATE

    if args.router_bias_update_rate is not None:
        return float(args.router_bias_update_rate)
    return PRESET_ROUTER_BIAS_UPDATE_RATE.get(preset_name(args) or "", DEFAULT_ROUTER_BIAS_UPDATE_RATE)


def model_config(args: Any) -> Glm53Config:
    from .presets import PRESETS, preset

    if args.hf_dir:
        if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
            raise SetupError(f"--hf-dir {args.hf_dir!r}: no config.json there")
        cfg = Glm53Config.from_hf(args.hf_dir)
    elif args.model_config and args.model_config not in PRESETS:
        if not os.path.isfile(args.model_config):
            raise SetupError(
                f"--model-config {args.model_config!r}: not a file and not a preset {sorted(PRESETS)}"
            )
        cfg = Glm53Config.from_hf(args.model_config)
    else:
        cfg = preset(preset_name(args) or "tiny")
    if args.mtp_loss_weight is not None:
        cfg = cfg.replace(mtp_loss_weight=args.mtp_loss_weight)
    if args.no_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    return cfg


def lr_at(step: int, args: Any) -> float:
    """Linear warmup to --lr over --warmup steps, then cosine decay to --min-lr at --train-iters."""
    if args.warmup > 0 and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(args.train_iters - args.warmup, 1)
    progress = min(max(step - args.warmup, 0) / span, 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def deepspeed_config(args: Any, world: int, gas: int) -> dict[str, Any]:
    """DeepSpeed's config: the --deepspeed_config file (checked against the command line) or a default."""
    ds_dp = world // args.etp  # DeepSpeed's data-parallel size (ETP is its model-parallel group)
    wanted = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "train_batch_size": args.micro_batch_size * gas * ds_dp,
        "gradient_clipping": args.clip_grad,
    }
    path = getattr(args, "deepspeed_config", None)
    if path:
        if not os.path.isfile(path):
            raise SetupError(f"--deepspeed_config {path!r}: no such file")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        for key, value in wanted.items():
            if key in config and config[key] != "auto" and config[key] != value:
                raise SetupError(
                    f"--deepspeed_config {path}: {key}={config[key]} contradicts the command line, which gives "
                    f"{key}={value} (--micro-batch-size {args.micro_batch_size}, --global-batch-size "
                    f"{args.global_batch_size or args.micro_batch_size * world}, world size {world}, ETP {args.etp}, "
                    f"--clip-grad {args.clip_grad})"
                )
    else:
        on_gpu = torch.cuda.is_available()
        config = {
            "zero_optimization": {
                "stage": 2 if on_gpu else 0,
                "contiguous_gradients": True,
                "overlap_comm": on_gpu,
            },
            "bf16": {"enabled": on_gpu},
        }
    config.update(wanted)
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.pop("optimizer", None)  # the trainer builds AdamW itself
    return config


def _batch_layout(args: Any, world: int) -> int:
    per_step = args.micro_batch_size * world
    global_batch = args.global_batch_size or per_step
    if args.micro_batch_size < 1:
        raise SetupError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if global_batch % per_step:
        raise SetupError(
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {args.micro_batch_size} "
            f"x world size {world} = {per_step}"
        )
    return global_batch // per_step


def _init_distributed() -> None:
    import deepspeed

    from ..parallel.initialize import default_backend

    if not dist.is_initialized():
        for key, value in (
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
        ):
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ:
            from ..parallel.initialize import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        deepspeed.init_distributed(dist_backend=default_backend(), verbose=False)
        if not torch.cuda.is_available():
            from ..compat.deepspeed_shm import register_cleanup

            register_cleanup()


# ----------------------------------------------------------------------------- set-up
def setup(args: Any) -> dict[str, Any]:
    from ..parallel.initialize import validate_layout
    from .data import SampleStream, load_tokenizer, resolve_dataset

    cfg = model_config(args)
    data = args.data or DEFAULT_DATA
    tokenizer_spec = args.tokenizer or (args.hf_dir if args.hf_dir else "bytes")
    if args.load:
        tag_ok = args.load_tag and os.path.isdir(os.path.join(args.load, args.load_tag))
        if not tag_ok and not os.path.isfile(os.path.join(args.load, "latest")):
            what = f"tag {args.load_tag!r}" if args.load_tag else "the file 'latest'"
            raise SetupError(f"--load {args.load!r}: no checkpoint there ({what} is missing)")
    try:
        tokenizer = load_tokenizer(tokenizer_spec)
    except (OSError, ValueError) as e:
        raise SetupError(f"--tokenizer {tokenizer_spec!r}: {e}") from e
    if tokenizer.vocab_size > cfg.vocab_size:
        raise SetupError(
            f"--tokenizer {tokenizer_spec!r} has {tokenizer.vocab_size} tokens, more than the model's vocab_size {cfg.vocab_size}"
        )

    _init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        validate_layout(world, args.ep, args.etp, cfg.n_routed_experts, cfg.moe_intermediate_size)
    except ValueError as e:
        raise SetupError(f"--ep {args.ep} --etp {args.etp}: {e}") from e
    gas = _batch_layout(args, world)
    ds_config = deepspeed_config(args, world, gas)
    output_dir = args.output_dir or os.path.join(
        "runs", args.model_config or ("hf" if args.hf_dir else "tiny")
    )
    cache_dir = os.path.join(output_dir, "data_cache")
    # Rank 0 tokenizes (text/jsonl) once; the others wait, then every rank reads the same indexed dataset.
    if rank == 0:
        prefix = _or_setup_error(lambda: resolve_dataset(data, tokenizer, tokenizer_spec, cache_dir))
    dist.barrier()
    if rank != 0:
        prefix = _or_setup_error(lambda: resolve_dataset(data, tokenizer, tokenizer_spec, cache_dir))
    stream = _or_setup_error(lambda: SampleStream(prefix, args.seq_length, args.seed, cfg.vocab_size))
    return dict(
        cfg=cfg, world=world, rank=rank, gas=gas, ds_config=ds_config, stream=stream, output_dir=output_dir
    )


def _or_setup_error(fn: Any) -> Any:
    try:
        return fn()
    except (OSError, ValueError) as e:
        raise SetupError(str(e)) from e


def build_engine(args: Any, env: dict[str, Any]) -> tuple[Any, Any]:
    import deepspeed

    from ..hf_loader import ExpertShard, SafetensorsCheckpoint, checkpoint_has_mtp, load_hf_state_into
    from ..model import Glm53Model
    from ..parallel import fp32_masters
    from ..parallel.deepspeed_setup import optimizer_param_groups, prepare_model_for_deepspeed
    from ..parallel.grad_sync import install_gradient_sync
    from ..parallel.initialize import DeepSpeedMpu, initialize
    from ..transformer_config import make_transformer_config

    cfg: Glm53Config = env["cfg"]
    layout = initialize(args.ep, args.etp, cfg.n_routed_experts, cfg.moe_intermediate_size)
    dtype = torch.bfloat16 if env["ds_config"].get("bf16", {}).get("enabled") else torch.float32
    recompute: dict[str, Any] = {}
    if args.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp", "moe"])
    elif args.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tconfig = make_transformer_config(
        cfg, dtype=dtype, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
        moe_seq_aux_loss_coef=args.aux_loss_coef, **recompute,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    use_mtp = cfg.num_nextn_predict_layers > 0
    if args.hf_dir:
        checkpoint = SafetensorsCheckpoint(args.hf_dir)
        use_mtp = use_mtp and checkpoint_has_mtp(checkpoint.keys(), cfg)
        model = Glm53Model(tconfig, mtp=use_mtp)
        shard = ExpertShard(args.ep, layout.ep_rank, args.etp, layout.etp_rank)
        load_hf_state_into(model, checkpoint, mtp=use_mtp, shard=shard)
    else:
        model = Glm53Model(tconfig, mtp=use_mtp)
    prepare_model_for_deepspeed(model, layout)
    optimizer = torch.optim.AdamW(
        optimizer_param_groups(model, weight_decay=args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )
    full_precision = fp32_masters.capture(model)  # DeepSpeed's bf16 cast rounds them; its masters need not be
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=env["ds_config"], mpu=DeepSpeedMpu(layout)
    )
    fp32_masters.restore(engine, full_precision)
    install_gradient_sync(engine, layout)
    return engine, layout


# ----------------------------------------------------------------------------- the loop
def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def train(args: Any) -> dict[str, Any]:
    from ..parallel.checkpoint import load_checkpoint, save_checkpoint
    from ..parallel.replicas import check_replicas
    from ..parallel.router_balance import update_router_bias
    from .metrics import MetricsWriter, plot_loss

    env = setup(args)
    engine, layout = build_engine(args, env)
    cfg, stream, rank, world, gas = env["cfg"], env["stream"], env["rank"], env["world"], env["gas"]
    start_step = 0
    if args.load:
        client = load_checkpoint(engine, layout, args.load, tag=args.load_tag)
        start_step = int(client.get("step", 0))  # 0 for a model-only (converted) checkpoint
        if "rng" in client:
            torch.set_rng_state(client["rng"])
    writer = (
        MetricsWriter(env["output_dir"], args.tensorboard_dir, append=bool(args.load)) if rank == 0 else None
    )
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(
            total=args.train_iters, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr
        )

    def save(step: int) -> None:
        check_replicas(engine.module, layout)
        save_checkpoint(
            engine,
            layout,
            args.save,
            f"step{step}",
            client_state={"step": step, "rng": torch.get_rng_state()},
        )

    last: dict[str, Any] = {}
    tokens_per_step = args.micro_batch_size * gas * world * args.seq_length
    bias_rate = router_bias_update_rate(args)
    for step in range(start_step, args.train_iters):
        started = time.perf_counter()
        lr = lr_at(step, args)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        sums = [0.0, 0.0, 0.0]  # total, lm, mtp
        for micro in range(gas):
            # a sample is seq_length + 1 tokens; the model takes HF-style labels aligned with its input and
            # shifts them itself, so the labels are the whole sample and the input drops its last token
            batch = stream.batch(step, micro, rank, world, args.micro_batch_size, gas).to(engine.device)
            loss = engine(batch[:, :-1], labels=batch[:, :-1], next_tokens=batch[:, -1:])
            finite = torch.tensor([float(torch.isfinite(loss.detach()).all())])
            if world > 1:
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if finite.item() < 1:
                raise TrainingStopped(
                    f"loss is {loss.item()} at step {step + 1} (micro-batch {micro}); training stopped before updating "
                    f"the weights. The last good checkpoint is in {args.save or '(none: --save not given)'}"
                )
            engine.backward(loss)
            engine.step()
            parts = engine.module.last_losses
            sums[0] += loss.item() / gas
            sums[1] += parts["lm_loss"] / gas
            sums[2] += parts.get("mtp_loss", 0.0) / gas
        balance = update_router_bias(engine.module, rate=bias_rate)
        total, lm, mtp = _mean_over_ranks(sums)
        step_time = time.perf_counter() - started
        norm = engine.get_global_grad_norm()
        last = dict(step=step + 1, loss=total, lm_loss=lm, lr=lr, grad_norm=None if norm is None else float(norm),
                    tokens_per_s=tokens_per_step / step_time, step_time=step_time,
                    moe_imbalance=max(balance.values()) if balance else None)  # fmt: skip
        if engine.module.mtp is not None:
            last["mtp_loss"] = mtp
        if writer is not None:
            writer.write(last)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{lm:.3f}", lr=f"{lr:.2e}")
            if args.log_interval and (step + 1) % args.log_interval == 0:
                progress.write(_format(last))
        if args.check_replicas_interval and (step + 1) % args.check_replicas_interval == 0:
            check_replicas(engine.module, layout)
        if args.save and args.save_interval and (step + 1) % args.save_interval == 0:
            save(step + 1)
    if (
        args.save
        and (not args.save_interval or args.train_iters % args.save_interval)
        and start_step < args.train_iters
    ):
        save(args.train_iters)
    if progress is not None:
        progress.close()
    if writer is not None:
        writer.close()
        if os.path.getsize(writer.path):
            plot_loss(writer.path, os.path.join(env["output_dir"], "loss.png"))
    if args.export_hf:
        from ..convert.export_hf import export_engine_to_hf

        export_engine_to_hf(engine, layout, cfg, args.export_hf, template=args.hf_dir)
    return last


def _format(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['lm_loss']:.4f}"]
    if "mtp_loss" in record:
        parts.append(f"mtp {record['mtp_loss']:.4f}")
    parts.append(f"lr {record['lr']:.2e}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if record.get("moe_imbalance") is not None:
        parts.append(f"MoE max/mean {record['moe_imbalance']:.2f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    from .args import build_parser

    args = build_parser().parse_args(argv)
    try:
        last = train(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"\nerror: {e}", file=sys.stderr)  # after the progress bar's line
        return 3
    if dist.is_initialized() and dist.get_rank() == 0 and last:
        print("final: " + _format(last))
    return 0
