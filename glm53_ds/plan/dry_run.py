"""A real-size dry run on meta tensors: one rank of a layout, the released model, forward and backward, shape by shape.

    python -m glm53_ds.plan.dry_run --ep 32 --etp 2 --seq-length 131072 [--sp 8] [--gpt-model] [--lora-rank 16]
        [--loss-chunk-mib 256] [--indexer-loss-coef 0.1]

No GPU and no memory: the model is built on the meta device as rank `--rank` of the smallest world that holds
EP x ETP x SP (EP may span the SP ranks: parallel/layout.py), joined
through torch's fake process-group backend (collectives return at once; every group, shard and split size is the
real layout's), and one micro-batch runs through the loss and back. What runs is the GPU path: every projection,
norm, mHC mix, router, the expert-parallel all-to-alls and grouped expert GEMMs, the DSA indexer's blocks (larger: a
block costs a meta run its loop, not memory), the chunked loss head. The fused kernels are their contracts: each is an op
whose meta implementation returns its outputs' shapes and keeps for backward what the kernel keeps (KDA, sparse
attention and mHC's write-back: layers/fused_kernels.py), the model calling them as on a GPU; and the expert
dispatch assumes balanced routing (meta tensors have no routing to read). A shape that does not fit, a
parameter without its gradient, a shard of the wrong size or an int32 index computation fails here, on a laptop,
instead of on the cluster after loading 640 GB.

Checks (`DryRun.problems`, empty when all hold):
  - every parameter the rank holds is the planner's count (plan/counts.py) and its shard (checkpoint/placement.py);
  - every trained parameter gets a gradient of its own shape, and no frozen one gets a gradient;
  - the loss is a scalar;
  - no operation computes in int32 (`Int32Audit`): token indices, expert offsets and document boundaries are int32
    only as stored values (positions < 2^31 at any length the config allows), their arithmetic runs in int64;
  - the fused kernels' largest operands are reported (`kernel_elements`): past 2^31 elements a kernel must
    address in int64 (this project's Triton kernels promote program ids to int64; fla-core kernels did not
    before fla PR #1082, issue #1080).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..checkpoint.placement import placement
from ..config import Glm53Config
from ..layers.dsa_indexer import DsaIndexer
from ..layers.fused_kernels import kernel_of_forward
from ..layers.moe import Glm53MoE
from ..layers.moe.experts import grouped_mm_step
from ..model import Glm53Model
from ..parallel import init_layout
from ..parallel.layout import smallest_world, validate_layout
from ..specs import get_glm53_block_spec, get_glm53_mtp_block_spec
from ..training.config import TrainConfig, check_seq_length
from ..training.model_converters import apply_converters
from ..training.options import add_options, check_bounds, say_defaults
from ..training.presets import PRESETS, named_config
from ..transformer_config import make_transformer_config
from .cli import check_numbers
from .counts import count_parameters, whole_model_on_meta
from .run import PlannedRun

INT32_LIMIT = 2**31 - 1

# ops that only store, move or select int32 values (no arithmetic on them)
_INT32_STORAGE_OPS = {
    "_to_copy", "to", "copy_", "clone", "view", "_unsafe_view", "reshape", "expand", "slice", "select",
    "transpose", "t", "permute", "unsqueeze", "squeeze", "cat", "stack", "masked_fill", "constant_pad_nd",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "full", "fill_", "detach",
    "alias", "index", "index_select", "gather", "contiguous", "split", "split_with_sizes", "narrow", "lift_fresh",
    "where", "zeros_like", "ones_like", "full_like", "zero_", "flatten", "unflatten", "_reshape_alias",
    "zeros", "new_zeros",
    # a clamp selects between a value and its bounds: it cannot leave the input's range (the torch reference's
    # gather of the selected latent rows clamps the -1 slots to 0, in the indexer loss's target)
    "clamp", "clamp_min", "clamp_max",
    # the indexer kernel's output: pool indices (< P, far below 2^31), ranked by int64 keys and addressed with int64
    # offsets inside (layers/indexer_topk_triton.py)
    "indexer_topk_triton",
    # collectives move values between ranks (SP gathers the key-padding mask and, on the dense path, the DSA
    # selections: ints, to every rank of the row)
    "allgather_", "_allgather_base_", "alltoall_base_", "alltoall_", "broadcast_",
}  # fmt: skip


class Int32Audit(TorchDispatchMode):
    """Records every operation that produces an int32 tensor by computing (not just storing or moving) it."""

    def __init__(self) -> None:
        super().__init__()
        self.computed: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _INT32_STORAGE_OPS and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in tree_leaves(out)
        ):
            self.computed[name] += 1
        return out


@dataclass
class DryRun:
    model: str
    seq_length: int
    micro_batch: int
    ep: int
    etp: int
    rank: int
    lora_rank: int
    gpt_model: bool
    sp: int = 1
    indexer_loss_coef: float = 0.0  # > 0: the indexer trains by its KL loss (docs/indexer_loss.md)
    parameters_held: int = 0  # elements this rank holds
    planned_held: int = 0  # the planner's count (plan/counts.py)
    trained_tensors: int = 0
    local_experts: int = 0
    loss_shape: tuple[int, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)
    int32_ops: dict[str, int] = field(default_factory=dict)
    kernel_elements: dict[str, int] = field(default_factory=dict)  # kernel -> its largest operand's elements
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verdict = "OK" if not self.problems else f"{len(self.problems)} problems"
        return (f"dry run {self.model} ({'GPTModel spec' if self.gpt_model else 'Glm53Model'}), rank {self.rank} "
                f"of EP {self.ep} x ETP {self.etp} x SP {self.sp}, {self.micro_batch} x {self.seq_length:,} tokens"
                f"{f', LoRA rank {self.lora_rank}' if self.lora_rank else ''}"
                f"{', the indexer loss' if self.indexer_loss_coef > 0 else ''}: {self.parameters_held:,} parameters "
                f"held ({self.local_experts} local experts), forward {self.seconds.get('forward', 0):.1f} s, "
                f"backward {self.seconds.get('backward', 0):.1f} s: {verdict}")  # fmt: skip


def fake_world(world: int, rank: int = 0) -> None:
    """Join a world of `world` ranks as `rank` through torch's fake backend (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(f"a dry run needs its own fake world of {world} ranks; this process already "
                               f"has a {dist.get_backend()} world of {dist.get_world_size()}")  # fmt: skip
        if dist.get_world_size() == world and dist.get_rank() == rank:
            return
        dist.destroy_process_group()  # another layout's fake world (the planner's --search)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


class KernelOperands(TorchDispatchMode):
    """Each fused kernel's largest operand in elements, by the kernel's name, as its op is called (the ops
    layers/fused_kernels.py lists): past 2^31 elements a kernel must address in int64."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kernel = kernel_of_forward(func)
        if kernel is not None:
            sizes = [t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.largest[kernel.name] = max(self.largest.get(kernel.name, 0), *sizes)
        return func(*args, **(kwargs or {}))


DRY_RUN_SCORE_BLOCK_BYTES = 2**34  # 16 GiB blocks of index scores: 64 blocks per DSA layer at 1M tokens


def dry_run(run: PlannedRun, rank: int = 0, gpt_model: bool = False, name: str = "model") -> DryRun:
    """Rank `rank` of the smallest world holding the run's EP x ETP x SP (a fake world, joined here), forward +
    backward on meta; under SP the rank gets whole rows and runs its shard, as the trainer's ranks do."""
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notices about optional kernels
    cfg, c = run.model, run.config
    seq_length, ep, etp, sp, lora_rank = c.seq_length, c.ep, c.etp, c.sp, c.lora_rank
    check_seq_length(seq_length, cfg)
    if gpt_model and sp > 1:
        raise ValueError("--gpt-model runs without sequence parallelism (a stock GPTModel has no SP groups)")
    if gpt_model and c.indexer_loss_coef > 0:
        raise ValueError("--gpt-model with --indexer-loss-coef: the indexer loss is Glm53Model's (a stock GPTModel "
                         "returns per-token LM losses only)")  # fmt: skip
    validate_layout(smallest_world(ep, etp, sp), ep, etp, cfg, sp=sp, seq_length=seq_length)
    micro_batch = c.micro_batch_size
    report = DryRun(
        name, seq_length, micro_batch, ep, etp, rank, lora_rank, gpt_model, sp, c.indexer_loss_coef
    )
    start = time.perf_counter()
    model, shard = rank_model_on_meta(run, rank=rank, gpt_model_length=seq_length if gpt_model else 0)
    report.seconds["build"] = time.perf_counter() - start
    report.parameters_held = sum(p.numel() for p in model.parameters())
    planned = count_parameters(run)
    report.planned_held = sum(planned.held(k) for k in planned.trained)
    if report.planned_held != report.parameters_held:
        report.problems.append(f"rank {rank} holds {report.parameters_held:,} parameter elements, the planner "
                               f"counts {report.planned_held:,}")  # fmt: skip
    if not gpt_model:  # shards by native name (a GPTModel names its tensors megatron's way)
        whole = {n: p.shape for n, p in whole_model_on_meta(run).named_parameters()}
        report.problems += shard_problems(model, whole, shard)
    report.local_experts = shard.num_local
    # shapes, not bytes, here: the DSA indexers score queries in the largest blocks (each block costs a Python
    # iteration, and a million tokens in the GPU's 1 GiB blocks are thousands); the planner keeps the GPU's
    for module in model.modules():
        if isinstance(module, DsaIndexer):
            module.score_block_bytes = DRY_RUN_SCORE_BLOCK_BYTES

    ids = torch.zeros(micro_batch, seq_length, dtype=torch.long, device="meta")
    audit = Int32Audit()
    operands = KernelOperands()
    with operands:
        with audit:
            start = time.perf_counter()
            if gpt_model:
                # megatron's MTP loss logger allocates on torch.cuda.current_device(): give it a meta buffer
                MTPLossLoggingHelper.tracker["values"] = torch.zeros(
                    cfg.num_nextn_predict_layers, device="meta"
                )
                loss = model(ids, None, None, labels=ids).sum()  # megatron's per-token losses [b, s]
            else:
                loss = model(ids, labels=ids)
            report.seconds["forward"] = time.perf_counter() - start
            report.loss_shape = tuple(loss.shape)
            start = time.perf_counter()
            loss.backward()
            report.seconds["backward"] = time.perf_counter() - start
    report.kernel_elements = operands.largest
    report.int32_ops = dict(audit.computed)
    if report.int32_ops:
        report.problems.append(f"int32 arithmetic (overflows past 2^31): {report.int32_ops}")
    if report.loss_shape != ():
        report.problems.append(f"the loss has shape {report.loss_shape}, not a scalar")
    report.trained_tensors = sum(p.requires_grad for p in model.parameters())
    report.problems += gradient_problems(model)
    return report


def rank_model_on_meta(
    run: PlannedRun, rank: int = 0, gpt_model_length: int = 0
) -> tuple[torch.nn.Module, Any]:
    """Rank `rank` of the smallest fake world that holds the run's EP x ETP x SP (joined here;
    `layout.smallest_world`): its model as the trainer builds it (bf16, the transformer config of its options:
    recompute, activation offload, MoE tiles, the loss head's chunk, the losses; its LoRA adapters and trainable
    set: the trainer's converters), on the meta device, and its expert shard. `gpt_model_length` > 0: a stock
    megatron `GPTModel` from the specs for sequences of that length instead."""
    cfg, c = run.model, run.config
    fake_world(smallest_world(c.ep, c.etp, c.sp), rank)
    layout = init_layout(c.ep, c.etp, cfg, sp=c.sp)
    gpt_model = gpt_model_length > 0
    tconfig = make_transformer_config(cfg, torch.bfloat16, mtp=gpt_model and cfg.num_nextn_predict_layers > 0,
                                      perform_initialization=False, **c.transformer_overrides(), **run.base_fields)  # fmt: skip
    with torch.device("meta"):
        model = _gpt_model(cfg, tconfig, gpt_model_length) if gpt_model else Glm53Model(
            tconfig, pg_collection=layout.pg_collection)  # fmt: skip
        apply_converters(model, run.converters())  # the trainer's: the adapters and the trainable set
    _check_traceable_experts(model, cfg, c.lora_rank)
    return model, layout.expert_shard(cfg)


class UntraceableLayout(ValueError):
    """A layout whose rank the meta trace cannot follow (`_check_traceable_experts`): refused for a plan of that
    layout, skipped and named by `--search`."""


def _check_traceable_experts(model: torch.nn.Module, cfg: Glm53Config, lora_rank: int) -> None:
    """Without expert parallelism (EP x ETP = 1, no dispatcher) the experts' forward takes the reference loop where
    their sizes misalign with the grouped GEMM: a host sync per expert, which a meta trace cannot follow (one error
    line instead of a traceback)."""
    step = grouped_mm_step(torch.bfloat16)
    for module in model.modules():
        if (
            isinstance(module, Glm53MoE)
            and module.dispatch is None
            and module.experts.impl(torch.bfloat16) == "loop"
        ):
            lora = f", LoRA rank {lora_rank}" if lora_rank else ""
            fix = f", or a LoRA rank that is a multiple of {step}" if lora_rank else ""
            raise UntraceableLayout(f"EP 1 x ETP 1: the experts' sizes (hidden {cfg.hidden_size}, FFN "
                             f"{module.experts.intermediate}{lora}) are not all multiples of {step} (bf16's grouped "
                             f"GEMM), so they would run the reference loop, which a meta trace cannot follow; plan "
                             f"at EP > 1{fix}")  # fmt: skip


def gradient_problems(model: torch.nn.Module) -> list[str]:
    """Trained parameters without a gradient of their shape, frozen ones with a gradient."""
    problems = []
    for name, p in model.named_parameters():
        if p.requires_grad and (p.grad is None or p.grad.shape != p.shape):
            got = None if p.grad is None else tuple(p.grad.shape)
            problems.append(f"{name}: gradient {got}, parameter {tuple(p.shape)}")
        elif not p.requires_grad and p.grad is not None:
            problems.append(f"{name}: frozen, but has a gradient")
    return problems


def _gpt_model(cfg: Glm53Config, tconfig: Any, seq_length: int) -> torch.nn.Module:
    """A stock megatron `GPTModel` from the project's specs (docs/usage.md, "Use in your own Megatron code")."""
    mtp = cfg.num_nextn_predict_layers > 0
    return GPTModel(tconfig, get_glm53_block_spec(cfg), vocab_size=cfg.vocab_size, max_sequence_length=seq_length,
                    position_embedding_type="none", share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                    mtp_block_spec=get_glm53_mtp_block_spec(cfg) if mtp else None)  # fmt: skip


def shard_problems(model: torch.nn.Module, whole: dict[str, torch.Size], shard: Any) -> list[str]:
    """Tensors whose shape is not their shard's (a replicated one whole, an expert tensor the rank's slice), given
    the whole model's shapes `whole`."""
    problems = []
    for name, p in model.named_parameters():
        if name not in whole:
            problems.append(f"{name}: not a parameter of the whole model")
            continue
        want = tuple(placement(name, tuple(whole[name]), shard).local_shape)
        if tuple(p.shape) != want:
            problems.append(f"{name}: shape {tuple(p.shape)}, its shard at {shard} is {want}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_ds.plan.dry_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-config", default="glm-5.3-flash", help=f"a preset ({', '.join(PRESETS)}) or a "
                   "config.json (default: glm-5.3-flash)")  # fmt: skip
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per row (default: 1)")
    p.add_argument("--rank", type=int, default=0, help="which rank of the layout's world to be (default: 0)")
    p.add_argument("--seq-length", type=int, default=131072)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument(
        "--gpt-model", action="store_true", help="through a stock megatron GPTModel from the specs"
    )
    p.add_argument("--layers", type=int, default=0, help="only the first N decoder layers (0: all)")
    trainers = ("loss_chunk_mib", "indexer_loss_coef")  # the trainer's options, with its defaults
    add_options(p, TrainConfig, names=trainers, defaults={n: getattr(TrainConfig, n) for n in trainers})
    say_defaults(p, {n: getattr(TrainConfig, n) for n in trainers})
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    try:
        check_numbers(args, dict(layers=0, rank=0))
        world = smallest_world(max(args.ep, 1), max(args.etp, 1), max(args.sp, 1))
        if args.rank >= world:
            raise ValueError(f"--rank {args.rank} is outside the world of {world} ranks of EP {args.ep} x ETP "
                             f"{args.etp} x SP {args.sp} (0 .. {world - 1})")  # fmt: skip
        cfg = named_config(args.model_config)
        if args.layers:
            cfg = first_layers(cfg, args.layers)
        run = PlannedRun.for_model(cfg, ep=args.ep, etp=args.etp, sp=args.sp, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, lora_rank=args.lora_rank,
                                   loss_chunk_mib=args.loss_chunk_mib, indexer_loss_coef=args.indexer_loss_coef)  # fmt: skip
        check_bounds(run.config)  # the options' declared least values (--ep 0, --loss-chunk-mib -1, ...)
        report = dry_run(run, args.rank, args.gpt_model, name=args.model_config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
        return 0 if not report.problems else 1
    for problem in report.problems:
        print(f"  {problem}")
    for kernel, n in report.kernel_elements.items():
        note = "past 2^31: needs int64 addressing" if n > INT32_LIMIT else "within int32"
        print(f"  {kernel}: largest operand {n:,} elements ({note})")
    print(report.summary())
    return 0 if not report.problems else 1


def first_layers(cfg: Glm53Config, n: int) -> Glm53Config:
    """`cfg` with only its first `n` decoder layers (their types kept)."""
    return dataclasses.replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                               mlp_layer_types=cfg.mlp_layer_types[:n], indexer_types=cfg.indexer_types[:n])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
