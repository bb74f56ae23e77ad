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

The flags are the trainer's options that change one rank's memory, generated from their declarations
(training/config.py), and a run file's options (`--config`, a recipe or a run's own <output-dir>/run.toml, which
records the world it ran at) are read as the trainer reads them: the run is one `PlannedRun` (plan/run.py).

Exit code: 0 when the run fits (with --search: some layout fits), 1 when it does not, 2 when the input is refused
(one `error:` line), so that `python -m glm53_ds.plan --config run.toml && deepspeed launch/train.py --config
run.toml ...` launches only what fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from ..parallel.layout import validate_layout
from ..parallel.rank_order import group_spans, placement_line
from ..training.args import build_parser
from ..training.config import TrainConfig, check_seq_length
from ..training.option_checks import (
    check_indexer_loss_trains,
    check_offload,
    check_optimizer_offload,
    check_recompute_losses,
)
from ..training.options import check_bounds, searched
from ..training.run_file import config_path
from .activations import plan_activations
from .counts import KINDS, count_parameters
from .memory import (
    HOST_RESERVE_FRACTION,
    RESERVE_FRACTION,
    WORLDS,
    RankMemory,
    host_fits,
    host_per_node,
    rank_memory,
    search,
    what_would_fit,
)
from .network import (
    CPU_ADAM_RATE,
    HOST_CORES,
    HOST_GBPS,
    MFU,
    NETWORK_GBPS,
    NVLINK_GBPS,
    PCIE_GBPS,
    StepTime,
    Traffic,
    offload_times,
    step_time,
    step_traffic,
)
from .run import PLANNER_ZERO, PlannedRun, parse_bytes, planned_config, planner_options
from .state import GiB

__all__ = ["main", "parse_bytes", "planned_run"]

GPUS_PER_NODE = 8
HOST_MEMORY = "2TB"  # an H200 node (DGX / HGX H200: 2 TB of host memory)
# exit codes: the run fits (or --search found a world), it does not, a refusal
FITS, DOES_NOT_FIT, REFUSED = 0, 1, 2
# a compiled run's activations are not modelled: the compiled step keeps less than eager's (inductor fuses what eager
# keeps between its kernels), measured only on the CPU so far (benchmarks/README.md)
COMPILED_PEAK_NOTE = (
    "on the CPU the compiled step's allocator peak is 0.54-0.69x eager's; not yet measured on CUDA"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm53_ds.plan", description=__doc__, argument_default=argparse.SUPPRESS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    planner_options(p)  # the trainer's options that change memory, as declared (training/config.py)
    p.add_argument("--zero", type=int, choices=[0, 1, 2], help="ZeRO stage (default: --deepspeed_config's; "
                   f"without it ZeRO {PLANNER_ZERO}, or under --config the trainer's GPU default, ZeRO 2)")  # fmt: skip
    p.add_argument(
        "--fp32", action="store_true", help="fp32 training (default: --deepspeed_config's dtype, bf16)"
    )
    varied = " / ".join(
        ["--world" if n == "gpus" else "--" + n.replace("_", "-") for n in searched(TrainConfig)]
    )
    p.add_argument("--search", action="store_true", help="the smallest world and the layouts that fit in it "
                   f"({varied} and --zero are searched)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node, the launcher's ranks per node (default "
                   f"{GPUS_PER_NODE}: an H100 / H200 node): which groups of the layout cross nodes")  # fmt: skip
    p.add_argument("--nvlink-gbps", type=float, help=f"GB/s per GPU and direction inside a node (default "
                   f"{NVLINK_GBPS:g}: NVLink 4)")  # fmt: skip
    p.add_argument("--network-gbps", type=float, help=f"GB/s per node between nodes (default {NETWORK_GBPS:g}: "
                   "8 x 400 Gb/s InfiniBand NDR)")  # fmt: skip
    p.add_argument(
        "--mfu", type=float, help=f"the model FLOP utilisation the step time assumes (default {MFU:g})"
    )
    p.add_argument("--pcie-gbps", type=float, help=f"GB/s per GPU and direction to its host (default {PCIE_GBPS:g}: "
                   "PCIe 5 x16): --offload-optimizer's copies")  # fmt: skip
    p.add_argument("--host-cores", type=int, help=f"CPU cores of one node (default {HOST_CORES}: an H200 node's two "
                   "56-core sockets), shared by its ranks' host updates under --offload-optimizer")  # fmt: skip
    p.add_argument("--host-gbps", type=float, help=f"memory bandwidth of one node's host in GB/s (default "
                   f"{HOST_GBPS:g}: two sockets of 8 DDR5-4800 channels at ~80%%)")  # fmt: skip
    p.add_argument("--cpu-adam-rate", type=float, help=f"DeepSpeedCPUAdam's elements per second per core (default "
                   f"{CPU_ADAM_RATE:.3g}, measured by benchmarks/cpu_adam.py; run it on your host)")  # fmt: skip
    p.add_argument("--host-memory", help=f"host memory of one node (default {HOST_MEMORY}: an H200 node's 2 TB): "
                   "what the ranks of a node hold there (--offload-optimizer, --offload-activations) is checked "
                   "against it")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--config", help="a trainer run file (`launch/train.py --config`, e.g. recipes/*.toml, or a run's "
                   "<output-dir>/run.toml): plan that run; flags given here override it")  # fmt: skip
    return p


def planned_run(argv: list[str]) -> tuple[PlannedRun, argparse.Namespace]:
    """The run the arguments describe (a run file's, flags over it) and the planner's own arguments; a ValueError
    names the first bad option, before any trace."""
    args = parser().parse_args(argv)
    args.gpus_per_node = getattr(args, "gpus_per_node", GPUS_PER_NODE)
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    args.host_bytes = parse_bytes(getattr(args, "host_memory", None) or HOST_MEMORY, "--host-memory")
    args.links = {"nvlink_gbps": getattr(args, "nvlink_gbps", NVLINK_GBPS),
                  "network_gbps": getattr(args, "network_gbps", NETWORK_GBPS), "mfu": getattr(args, "mfu", MFU)}  # fmt: skip
    args.host_links = {"pcie_gbps": getattr(args, "pcie_gbps", PCIE_GBPS),
                       "host_cores": getattr(args, "host_cores", HOST_CORES),
                       "host_gbps": getattr(args, "host_gbps", HOST_GBPS),
                       "cpu_adam_rate": getattr(args, "cpu_adam_rate", CPU_ADAM_RATE)}  # fmt: skip
    for name, value in {**args.links, **args.host_links}.items():
        if not value > 0 or (name == "mfu" and value > 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive{' and at most 1' * (name == 'mfu')}, "
                             f"got {value}")  # fmt: skip
    own = {"links", "host_links", "gpus_per_node", "host_memory", "host_bytes", *args.links, *args.host_links}
    given = {k: v for k, v in vars(args).items() if k not in own}
    path = config_path(argv)
    config = planned_config(given, path, build_parser())
    check_bounds(config, spelled={"gpus": "--world"})  # the options' declared least values
    zero = given.get("zero")
    if zero is None and path is None and not config.deepspeed_config:
        zero = PLANNER_ZERO  # the planner's default stage for a run given by flags
    run = PlannedRun.of(config, zero=zero, bf16=False if given.get("fp32") else None)
    parse_bytes(config.gpu_memory)
    check_seq_length(config.seq_length, run.model)
    check_offload(config.offload_activations, config.recompute)
    check_optimizer_offload(config.offload_optimizer, run.zero, "the run has ")
    check_recompute_losses(config.recompute, config.aux_loss_coef, config.indexer_loss_coef)
    check_indexer_loss_trains(dataclasses.replace(config, trainable=run.trainable))
    return run, args


def main(argv: list[str] | None = None) -> int:
    """Exit code 0: the run fits (--search: some layout does); 1: it does not (no layout does); 2: refused."""
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notices about optional kernels
    try:
        run, args = planned_run(argv)
        if getattr(args, "search", False):
            return _search(run, as_json=getattr(args, "json", False), host_bytes=args.host_bytes,
                           gpus_per_node=args.gpus_per_node)  # fmt: skip
        c = run.config
        validate_layout(run.world, c.ep, c.etp, run.model, sp=c.sp, seq_length=c.seq_length)
        # the trace first: it joins the layout's fake world, in which the counts' meta build runs too
        profile = plan_activations(run)
        counts = count_parameters(run)
        memory = rank_memory(run, counts, profile)
    except (OSError, ValueError) as e:  # the trainer's SetupError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return REFUSED
    c = run.config
    name = _model_name(run)
    result = {
        "model": name, "world": run.world, "ep": c.ep, "etp": c.etp, "sp": c.sp,
        "zero": run.zero, "dtype": "bf16" if run.bf16 else "fp32", "lora_rank": c.lora_rank,
        "offload_activations": c.offload_activations, "moe_tile_mib": c.moe_tile_mib,
        "loss_chunk_mib": c.loss_chunk_mib, "indexer_loss_coef": c.indexer_loss_coef,
        "seq_length": c.seq_length, "micro_batch_size": c.micro_batch_size, "recompute": c.recompute,
        "parameters": {"total": counts.total, "active": counts.active, "trained": counts.trained,
                       "frozen": counts.frozen, "buffers": counts.buffers},
        "bytes_per_rank": memory.state.as_dict(), "memory": memory.as_dict(), "gpu_memory": run.gpu,
    }  # fmt: skip
    per_node, links = args.gpus_per_node, args.links
    node = [r // per_node for r in range(run.world)]  # the launchers number ranks node by node
    result["placement"] = {
        s.name: {"size": s.size, "nodes": s.nodes} for s in group_spans(node, c.ep, c.etp, c.sp)
    }
    traffic = step_traffic(run, counts)
    host_s = offload_times(run, counts, min(per_node, run.world), **args.host_links)
    timing = step_time(run, traffic, node, **links, host_s=host_s)
    result["network"] = {**links, "bytes_per_rank": traffic.by_group, "seconds": timing.groups_s,
                         "offload_s": timing.host_s, **(args.host_links if host_s else {}),
                         "compute_s": timing.compute_s, "step_s": timing.total_s,
                         "tokens_per_s_per_gpu": timing.tokens_per_s_per_gpu, "bound": timing.bound}  # fmt: skip
    pinned = memory.host + memory.host_state  # the offloaded optimizer state's buffers and the layer inputs
    host_rank = pinned + memory.host_state_pageable
    host_node, host_ok = host_per_node(memory, per_node), host_fits(memory, args.host_bytes, per_node)
    result["host"] = {"per_rank": host_rank, "per_node": host_node, "pinned_per_rank": pinned,
                      "pageable_per_rank": memory.host_state_pageable,
                      "optimizer_state_per_rank": memory.host_state + memory.host_state_pageable,
                      "activations_per_rank": memory.host, "host_memory": args.host_bytes, "fits": host_ok}  # fmt: skip
    result["trainer_flags"] = run.trainer_flags() + run.run_flags()
    hints = [] if memory.fits else what_would_fit(memory)
    result["would_fit"] = hints
    code = FITS if memory.fits and host_ok else DOES_NOT_FIT
    if getattr(args, "json", False):
        print(json.dumps(result))
        return code
    adapters = " with the LoRA adapters" if c.lora_rank else ""
    print(f"{name}: {counts.total:,} parameters{adapters} ({counts.active:,} active per token); "
          f"{run}, {result['dtype']}{f', LoRA rank {c.lora_rank}' if c.lora_rank else ''}; "
          f"{c.micro_batch_size} x {c.seq_length:,} tokens per micro-batch")  # fmt: skip
    print("per rank, parameters held (trained / frozen):")
    for kind in KINDS:
        print(f"  {kind:<11} {counts.trained[kind]:>16,} / {counts.frozen[kind]:,}")
    if counts.block_fp8:
        print(f"  block-FP8   {0:>16,} / {counts.block_fp8:,} (1 byte each, + {counts.block_fp8_scales:,} fp32 "
              f"block scales)")  # fmt: skip
    print("per rank, training state:")
    for key, value in memory.state.as_dict().items():
        print(f"  {key:<11} {value / GiB:10.2f} GiB")
    _print_memory(memory)
    if host_rank:
        print(f"host memory: {host_rank / GiB:.2f} GiB per rank, pinned {pinned / GiB:.2f} (optimizer state "
              f"{memory.host_state / GiB:.2f}, layer inputs {memory.host / GiB:.2f}) and pageable "
              f"{memory.host_state_pageable / GiB:.2f} (Adam moments); {host_node / GiB:,.1f} GiB per node of "
              f"{min(per_node, run.world)} GPUs, of "
              f"{args.host_bytes / GiB:,.0f} GiB (--host-memory; {HOST_RESERVE_FRACTION:.0%} kept for the system and "
              f"the data): {'fits' if host_ok else 'does NOT fit'}")  # fmt: skip
    print(placement_line(node, c.ep, c.etp, c.sp) + f" (at {per_node} GPUs per node)")
    _print_network(traffic, timing, links)
    if memory.fits:
        print(f"the trainer's flags: deepspeed launch/train.py {run.trainer_flags()} "
              f"--seq-length {c.seq_length} --micro-batch-size {c.micro_batch_size}"
              + (f" --lora-rank {c.lora_rank}" if c.lora_rank else "") + run.run_flags())  # fmt: skip
    elif hints:
        print("it would fit with any one of: " + "; ".join(hints))
    else:
        print("no change tried fits (recompute, SP, ZeRO 2, twice the GPUs, half the row, full recompute with SP or "
              "twice the GPUs): python -m glm53_ds.plan --search finds the smallest world that does")  # fmt: skip
    return code


def _model_name(run: PlannedRun) -> str:
    """How the run names its model: --hf-dir, --model-config, else the trainer's default (tiny)."""
    return run.config.hf_dir or run.config.model_config or "tiny"


def _print_memory(memory: RankMemory) -> None:
    tokens = (
        "" if memory.run.config.sp == 1 else f", each rank 1/{memory.run.config.sp} of every sample's tokens"
    )
    print(f"per rank, activations (recompute {memory.run.config.recompute}{tokens}):")
    for kind, row in memory.by_kind.items():
        print(f"  {kind:<38} {row['layers']:>3} x {row['saved_per_layer'] / GiB:8.3f} GiB kept per layer")
    print(f"  {'loss head (chunked), in its backward':<38} {memory.loss_head / GiB:14.2f} GiB")
    print(f"  {'peak (kept from the forward)':<38} {memory.activations / GiB:14.2f} GiB "
          f"({memory.activations_saved / GiB:.2f})")  # fmt: skip
    if memory.run.config.compile:
        print(f"  the run's --compile: counted as eager, an upper bound ({COMPILED_PEAK_NOTE})")
    if memory.run.config.offload_activations:
        print(f"pinned host memory (the layers' kept inputs, --offload-activations) {memory.host / GiB:.2f} GiB per "
              "rank: not in the GPU total")  # fmt: skip
    print(f"communication buffers (ZeRO-{memory.run.zero} reduction buckets) "
          f"{memory.communication / GiB:.2f} GiB")  # fmt: skip
    usable = (1 - RESERVE_FRACTION) * memory.gpu
    verdict = "fits" if memory.fits else "does NOT fit"
    print(f"total {memory.total / GiB:.2f} GiB per rank of {memory.gpu / GiB:.2f} GiB ({usable / GiB:.2f} GiB after "
          f"a {RESERVE_FRACTION:.0%} reserve for the CUDA context, NCCL and fragmentation): {verdict}")  # fmt: skip


def _print_network(traffic: Traffic, timing: StepTime, links: dict[str, float]) -> None:
    """The step-time model (plan/network.py): each group's bytes and time beside the FLOPs'."""
    print(f"per rank and step, the network (NVLink {links['nvlink_gbps']:g} GB/s per GPU, {links['network_gbps']:g} "
          f"GB/s per node between nodes; plan/network.py):")  # fmt: skip
    for group, nbytes in traffic.by_group.items():
        print(f"  {group:<11} {nbytes / GiB:10.2f} GiB  {timing.groups_s[group]:8.3f} s")
    for term, seconds in timing.host_s.items():  # ZeRO-Offload
        print(f"  {term:<11} {'':>14} {seconds:8.3f} s (--offload-optimizer cpu)")
    print(f"  {'FLOPs':<11} {'':>14} {timing.compute_s:8.3f} s at {links['mfu']:.0%} MFU")
    print(f"step {timing.total_s:.3f} s, nothing overlapped: {timing.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; "
          f"bound by {timing.bound}")  # fmt: skip


def _search(
    run: PlannedRun, as_json: bool, host_bytes: int | None = None, gpus_per_node: int = GPUS_PER_NODE
) -> int:
    worlds = (run.config.gpus,) if run.config.gpus else WORLDS
    progress = None if as_json else (lambda line: print(f"searching: {line}", file=sys.stderr, flush=True))
    found = search(run, worlds=worlds, progress=progress, host_bytes=host_bytes, gpus_per_node=gpus_per_node)
    c, name = run.config, _model_name(run)
    what = (
        f"{'LoRA rank ' + str(c.lora_rank) if c.lora_rank else 'full fine-tuning'}, "
        f"{c.micro_batch_size} x {c.seq_length:,} tokens, {c.gpu_memory} GPUs"
    )
    code = FITS if found.fitting else DOES_NOT_FIT
    if as_json:
        print(json.dumps({"model": name, "world": found.world,
                          "fits": [dict(m.as_dict(), trainer_flags=m.run.trainer_flags()) for m in found.fitting],
                          "nearest": None if found.nearest is None else found.nearest.as_dict(),
                          "not_planned": found.not_planned}))  # fmt: skip
        return code
    where = f"{c.gpus} GPUs" if c.gpus else f"up to {WORLDS[-1]} GPUs"
    for reason in found.not_planned:
        print(f"not planned: {reason}")
    if not found.fitting:
        print(f"{name}, {what}: no layout of {where} fits")
        if found.nearest is not None:
            m = found.nearest
            print(f"  nearest: {m.run}: {m.total / GiB:.1f} GiB per rank of {(1 - RESERVE_FRACTION) * run.gpu / GiB:.1f} "
                  f"usable (state {m.state.total / GiB:.1f}, activations {m.activations / GiB:.1f})")  # fmt: skip
        return code
    print(f"{name}, {what}: the smallest world that fits is {found.world} GPUs; its layouts, the "
          "cheapest first (less recompute, less SP, less ETP, then less memory), as the trainer's flags:")  # fmt: skip
    for m in found.fitting:
        print(f"  {m.run}: {m.total / GiB:.1f} GiB per rank (state {m.state.total / GiB:.1f}, activations "
              f"{m.activations / GiB:.1f})")  # fmt: skip
        print(f"      deepspeed --num_gpus {m.run.world} launch/train.py {m.run.trainer_flags()} "
              f"--seq-length {c.seq_length} --micro-batch-size {c.micro_batch_size}"
              + (f" --lora-rank {c.lora_rank}" if c.lora_rank else "") + run.run_flags())  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
