"""`python -m glm53_ds.plan`: one rank's memory for a model config and layout, or the smallest layouts that fit.

    python -m glm53_ds.plan --model-config glm-5.3-flash --world 64 --ep 32 --etp 2 --zero 2 --seq-length 8192
        [--sp S] [--micro-batch-size M] [--recompute none|selective|full] [--lora-rank 16] [--fp32]
        [--moe-tile-mib N] [--loss-chunk-mib 256] [--gpu-memory 141GB] [--json]
    python -m glm53_ds.plan --search --seq-length 32768 [--lora-rank 16] [--gpu-memory 80GB]
    python -m glm53_ds.plan --config recipes/lora_r16_8xh200_8k.toml  # the trainer's run file ([planning] gpus)

Prints per rank: the parameters held by kind (exact: the model built on the meta device), the bytes of weights,
gradients, fp32 masters and Adam moments as the engine holds them (state.py), the activations per layer kind with
the recompute mode and the loss head (measured on meta per layer kind and composed over the model: activations.py),
ZeRO's communication buffers, and the total against --gpu-memory (memory.py). `--search`: the smallest world (GPUs)
at which some layout fits, with the layouts that fit there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import warnings

from ..config import Glm53Config
from ..parallel.layout import validate_layout
from ..training.args import build_parser
from ..training.config import TrainConfig, check_seq_length
from ..training.option_checks import check_offload, check_recompute_losses
from ..training.options import add_options, say_defaults
from ..training.presets import PRESETS, named_config
from ..training.run_file import config_path, read_config
from ..training.run_plan import default_deepspeed_config, zero_stage_and_bf16
from ..training.trainable import indexer_loss_trainable
from .activations import plan_activations
from .cli import check_numbers
from .counts import KINDS, count_parameters
from .dry_run import LOSS_CHUNK_MIB
from .memory import (
    RESERVE_FRACTION,
    WORLDS,
    Layout,
    RankMemory,
    rank_memory,
    search,
    what_would_fit,
)
from .state import GiB

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'141GB', '80GiB', '141e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 141GB or 80GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def run_file_arguments(path: str) -> list[str]:
    """The trainer's run file (`--config run.toml`, training/run_file.py) as the planner's arguments: the run as the
    trainer would make it (its defaults where the file gives nothing). The model: --hf-dir's config, else
    --model-config, else the trainer's default (tiny); the DeepSpeed config's ZeRO stage and dtype, or the trainer's
    GPU default (`run_plan.default_deepspeed_config`); [planning] gpus as --world, gpu_memory as --gpu-memory."""
    trainer = build_parser()
    file_argv, _ = read_config(path, trainer)
    run = vars(trainer.parse_args(file_argv))  # options not given are absent (the trainer resolves defaults)
    given = {key: value for key, value in run.items() if value is not None}
    if given.get("load") and not (given.get("hf_dir") or given.get("model_config")):
        raise ValueError(f"--config {path}: the model is --load's; give [model] model_config for the planner")
    out = ["--model-config", given.get("hf_dir") or given.get("model_config") or "tiny"]
    for name in ("ep", "etp", "sp", "seq_length", "micro_batch_size", "recompute", "lora_rank",
                 "indexer_loss_coef"):  # fmt: skip
        if name in given:
            out += [f"--{name.replace('_', '-')}", str(given[name])]
    out += ["--offload-activations"] if given.get("offload_activations") else []
    out += ["--moe-tile-mib", str(given["moe_tile_mib"])] if given.get("moe_tile_mib") else []
    out += ["--loss-chunk-mib", str(given["loss_chunk_mib"])] if "loss_chunk_mib" in given else []
    ds = default_deepspeed_config(on_gpu=True)  # the trainer's, on the GPUs the run is planned for
    if given.get("deepspeed_config"):
        try:
            with open(given["deepspeed_config"], encoding="utf-8") as f:
                ds = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--config {path}: deepspeed_config {given['deepspeed_config']!r}: {e}") from e
    zero, bf16 = zero_stage_and_bf16(ds)
    out += (
        ["--zero", str(zero)] + ([] if bf16 else ["--fp32"]) + (["--no-mtp"] if given.get("no_mtp") else [])
    )
    if "gpus" in given:
        out += ["--world", str(given["gpus"])]
    return out + (["--gpu-memory", given["gpu_memory"]] if "gpu_memory" in given else [])


# The trainer's options the planner takes, and its defaults for them (the released model's usual run, not the
# tiny CPU job's).
PLANNER_DEFAULTS = dict(ep=1, etp=1, sp=1, seq_length=8192, micro_batch_size=1, recompute="none", lora_rank=0,
                        no_mtp=False, offload_activations=False, moe_tile_mib=0, loss_chunk_mib=LOSS_CHUNK_MIB,
                        indexer_loss_coef=0.0, gpu_memory="141GB")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_ds.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-config", default="glm-5.3-flash", help=f"a preset ({', '.join(PRESETS)}) or a "
                   "config.json (default: glm-5.3-flash)")  # fmt: skip
    p.add_argument("--world", type=int, help="ranks (GPUs); required without --search; with it, the one world to "
                   "search (default: 8 to 1024)")  # fmt: skip
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage (default: 1)")
    p.add_argument("--fp32", action="store_true", help="fp32 training (default: bf16)")
    # the trainer's options, as the trainer declares them (training/config.py), with the planner's defaults
    add_options(p, TrainConfig, names=tuple(PLANNER_DEFAULTS), defaults=PLANNER_DEFAULTS)
    say_defaults(p, PLANNER_DEFAULTS)
    p.add_argument("--search", action="store_true", help="the smallest world and the layouts that fit in it "
                   "(--world / --ep / --etp / --sp / --zero / --recompute are searched)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--config", help="a trainer run file (`launch/train.py --config`, e.g. recipes/*.toml): plan that "
                   "run; flags given here override it")  # fmt: skip
    argv = sys.argv[1:] if argv is None else list(argv)
    path = config_path(argv)
    try:
        from_file = run_file_arguments(path) if path else []
    except ValueError as e:  # the trainer's SetupError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = p.parse_args(from_file + argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notices about optional kernels
    try:
        check_numbers(args, dict(world=1, ep=1, etp=1, sp=1, seq_length=1, micro_batch_size=1, lora_rank=0,
                                 moe_tile_mib=0, loss_chunk_mib=0, indexer_loss_coef=0))  # fmt: skip
        cfg = named_config(args.model_config)
        if args.no_mtp:
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
        gpu = parse_bytes(args.gpu_memory)
        check_seq_length(args.seq_length, cfg)
        if args.search:
            return _search(args, cfg, gpu)
        if args.world is None:
            raise ValueError("--world is required (or --search for the smallest layouts that fit)")
        validate_layout(args.world, args.ep, args.etp, cfg, sp=args.sp, seq_length=args.seq_length)
        check_offload(args.offload_activations, args.recompute)
        check_recompute_losses(args.recompute, 0.0, args.indexer_loss_coef)
        layout = Layout(args.world, args.ep, args.etp, args.sp, args.zero, args.recompute, args.offload_activations,
                        args.moe_tile_mib, args.loss_chunk_mib)  # fmt: skip
        # the trace first: it joins the layout's fake world, in which the counts' meta build runs too
        profile = plan_activations(cfg, args.seq_length, args.micro_batch_size, args.ep, args.etp, args.sp,
                                   args.recompute, args.lora_rank, args.offload_activations,
                                   args.moe_tile_mib, args.loss_chunk_mib, args.indexer_loss_coef)  # fmt: skip
        counts = count_parameters(cfg, args.ep, args.etp, lora_rank=args.lora_rank,
                                  train_indexer=args.indexer_loss_coef > 0)  # fmt: skip
        memory = rank_memory(cfg, layout, args.seq_length, args.micro_batch_size, gpu, counts, bf16=not args.fp32,
                             lora_rank=args.lora_rank, profile=profile,
                             indexer_loss_coef=args.indexer_loss_coef)  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {
        "model": args.model_config, "world": args.world, "ep": args.ep, "etp": args.etp, "sp": args.sp,
        "zero": args.zero, "dtype": "fp32" if args.fp32 else "bf16", "lora_rank": args.lora_rank,
        "offload_activations": args.offload_activations, "moe_tile_mib": args.moe_tile_mib,
        "loss_chunk_mib": args.loss_chunk_mib, "indexer_loss_coef": args.indexer_loss_coef,
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size, "recompute": args.recompute,
        "parameters": {"total": counts.total, "active": counts.active, "trained": counts.trained,
                       "frozen": counts.frozen, "buffers": counts.buffers},
        "bytes_per_rank": memory.state.as_dict(), "memory": memory.as_dict(), "gpu_memory": gpu,
    }  # fmt: skip
    result["trainer_flags"] = layout.trainer_flags(bf16=not args.fp32) + _run_flags(args)
    hints = [] if memory.fits else what_would_fit(cfg, memory, args.seq_length, args.micro_batch_size,
                                                  bf16=not args.fp32, lora_rank=args.lora_rank,
                                                  indexer_loss_coef=args.indexer_loss_coef)  # fmt: skip
    result["would_fit"] = hints
    if args.json:
        print(json.dumps(result))
        return 0
    adapters = " with the LoRA adapters" if args.lora_rank else ""
    print(f"{args.model_config}: {counts.total:,} parameters{adapters} ({counts.active:,} active per token); "
          f"{layout}, {result['dtype']}{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}; "
          f"{args.micro_batch_size} x {args.seq_length:,} tokens per micro-batch")  # fmt: skip
    print("per rank, parameters held (trained / frozen):")
    for kind in KINDS:
        print(f"  {kind:<11} {counts.trained[kind]:>16,} / {counts.frozen[kind]:,}")
    print("per rank, training state:")
    for key, value in memory.state.as_dict().items():
        print(f"  {key:<11} {value / GiB:10.2f} GiB")
    _print_memory(memory)
    if memory.fits:
        print(f"the trainer's flags: deepspeed launch/train.py {layout.trainer_flags(bf16=not args.fp32)} "
              f"--seq-length {args.seq_length} --micro-batch-size {args.micro_batch_size}"
              + (f" --lora-rank {args.lora_rank}" if args.lora_rank else "") + _run_flags(args))  # fmt: skip
    elif hints:
        print("it would fit with any one of: " + "; ".join(hints))
    else:
        print("no change tried fits (recompute, SP, ZeRO 2, twice the GPUs, half the row, full recompute with SP or "
              "twice the GPUs): python -m glm53_ds.plan --search finds the smallest world that does")  # fmt: skip
    return 0


def _print_memory(memory: RankMemory) -> None:
    tokens = "" if memory.layout.sp == 1 else f", each rank 1/{memory.layout.sp} of every sample's tokens"
    print(f"per rank, activations (recompute {memory.layout.recompute}{tokens}):")
    for kind, row in memory.by_kind.items():
        print(f"  {kind:<38} {row['layers']:>3} x {row['saved_per_layer'] / GiB:8.3f} GiB kept per layer")
    print(f"  {'loss head (chunked), in its backward':<38} {memory.loss_head / GiB:14.2f} GiB")
    print(f"  {'peak (kept from the forward)':<38} {memory.activations / GiB:14.2f} GiB "
          f"({memory.activations_saved / GiB:.2f})")  # fmt: skip
    if memory.layout.offload_activations:
        print(f"pinned host memory (the layers' kept inputs, --offload-activations) {memory.host / GiB:.2f} GiB per "
              "rank: not in the GPU total")  # fmt: skip
    print(f"communication buffers (ZeRO-{memory.layout.zero} reduction buckets) "
          f"{memory.communication / GiB:.2f} GiB")  # fmt: skip
    usable = (1 - RESERVE_FRACTION) * memory.gpu
    verdict = "fits" if memory.fits else "does NOT fit"
    print(f"total {memory.total / GiB:.2f} GiB per rank of {memory.gpu / GiB:.2f} GiB ({usable / GiB:.2f} GiB after "
          f"a {RESERVE_FRACTION:.0%} reserve for the CUDA context, NCCL and fragmentation): {verdict}")  # fmt: skip


def _search(args: argparse.Namespace, cfg: Glm53Config, gpu: int) -> int:
    worlds = (args.world,) if args.world else WORLDS
    progress = None if args.json else (lambda line: print(f"searching: {line}", file=sys.stderr, flush=True))
    found = search(cfg, args.seq_length, args.micro_batch_size, gpu, bf16=not args.fp32, lora_rank=args.lora_rank,
                   worlds=worlds, progress=progress, loss_chunk_mib=args.loss_chunk_mib,
                   indexer_loss_coef=args.indexer_loss_coef)  # fmt: skip
    bf16 = not args.fp32
    what = (
        f"{'LoRA rank ' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, "
        f"{args.micro_batch_size} x {args.seq_length:,} tokens, {args.gpu_memory} GPUs"
    )
    if args.json:
        print(json.dumps({"model": args.model_config, "world": found.world,
                          "fits": [dict(m.as_dict(), trainer_flags=m.layout.trainer_flags(bf16)) for m in found.fitting],
                          "nearest": None if found.nearest is None else found.nearest.as_dict(),
                          "not_planned": found.not_planned}))  # fmt: skip
        return 0 if found.fitting else 1
    where = f"{args.world} GPUs" if args.world else f"up to {WORLDS[-1]} GPUs"
    for reason in found.not_planned:
        print(f"not planned: {reason}")
    if not found.fitting:
        print(f"{args.model_config}, {what}: no layout of {where} fits")
        if found.nearest is not None:
            m = found.nearest
            print(f"  nearest: {m.layout}: {m.total / GiB:.1f} GiB per rank of {(1 - RESERVE_FRACTION) * gpu / GiB:.1f} "
                  f"usable (state {m.state.total / GiB:.1f}, activations {m.activations / GiB:.1f})")  # fmt: skip
        return 1
    print(f"{args.model_config}, {what}: the smallest world that fits is {found.world} GPUs; its layouts, the "
          "cheapest first (less recompute, less SP, less ETP, then less memory), as the trainer's flags:")  # fmt: skip
    for m in found.fitting:
        print(f"  {m.layout}: {m.total / GiB:.1f} GiB per rank (state {m.state.total / GiB:.1f}, activations "
              f"{m.activations / GiB:.1f})")  # fmt: skip
        print(f"      deepspeed --num_gpus {m.layout.world} launch/train.py {m.layout.trainer_flags(bf16)} "
              f"--seq-length {args.seq_length} --micro-batch-size {args.micro_batch_size}"
              + (f" --lora-rank {args.lora_rank}" if args.lora_rank else "") + _run_flags(args))  # fmt: skip
    return 0


def _run_flags(args: argparse.Namespace) -> str:
    """The run's flags beside the layout's that change what it holds: the indexer loss (it trains the indexer; a
    LoRA run names it trainable too, as the trainer asks)."""
    if args.indexer_loss_coef <= 0:
        return ""
    trainable = indexer_loss_trainable(args.lora_rank > 0, True)
    return f" --indexer-loss-coef {args.indexer_loss_coef}" + (
        f" --trainable '{trainable}'" if trainable else ""
    )


if __name__ == "__main__":
    sys.exit(main())
