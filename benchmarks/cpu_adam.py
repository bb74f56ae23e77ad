"""ZeRO-Offload measured (#61): the host's optimizer step, and what the device keeps, with and without offload.

1. **The host update.** One optimizer step over `--params` fp32 parameters (default 100M, in four tensors, as a
   ZeRO partition is a few flat tensors): DeepSpeedCPUAdam (AdamW mode, DeepSpeed's vectorised op, what
   `--offload-optimizer cpu` updates with) against `torch.optim.AdamW` (foreach) and `torch.optim.AdamW(fused=True)`,
   process CPU time beside wall time, medians of 3, at 1 thread; DeepSpeedCPUAdam again at every core. The
   planner's host-update term divides a rank's partition by the rate measured here, per core
   (`glm53_ds.plan.network.CPU_ADAM_ELEMENTS_PER_S_PER_CORE`).
2. **The device side of a step.** Two ranks (gloo, or NCCL on two GPUs; one GPU: one rank at EP 1), the tiny model
   at EP 2, bf16 ZeRO 1,
   one AdamW step, with and without `offload_optimizer: cpu`. On CUDA: the caching allocator's bytes after the
   step and its peak over the step. On CPU every tensor lives in the same memory, so the bytes are counted by
   where DeepSpeed places them: every tensor the engine holds (the module's parameters, gradients and buffers, the
   ZeRO optimizer's attributes, the optimizer's state; each storage once), and of those the host's: under offload,
   the fp32 partitions with their gradients and Adam moments, and DeepSpeed's CPU-side buffers.
3. **Gradient accumulation in bf16.** Under ZeRO-Offload DeepSpeed sums a bf16 run's micro-batch gradients in bf16
   (ZeRO 1 in `.grad`, ZeRO 2 in its host buffer), where the device path sums in fp32. The tiny model in bf16 over
   `--micro` micro-batches: the bf16 sum of its gradients against the fp32 sum of the same gradients, and both
   against the fp32 model's summed gradient (relative L2 over every matrix).

    python3 benchmarks/cpu_adam.py [--params 100000000] [--device cpu|cuda]

Last line: `cpu_adam host_time_ratio_vs_torch=<DeepSpeedCPUAdam / torch AdamW, CPU time> elements_per_s_per_core=…
device_state_ratio=<offloaded / not, device bytes after the step> bf16_accumulation_error=<bf16 sum vs fp32 sum>`; JSON in benchmarks/results/cpu_adam_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import cpu_and_wall, device_description, join_rank, print_table, write_results  # noqa: E402


def _parameters(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for size in (n // 4,) * 3 + (n - 3 * (n // 4),):
        p = torch.randn(size, generator=g).requires_grad_()
        p.grad = torch.randn(size, generator=g) * 1e-3
        out.append(p)
    return out


def host_update(n: int, threads: int) -> list[dict[str, Any]]:
    """One AdamW step over `n` parameters per optimizer, at `threads` threads (process CPU time, wall)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from glm53_ds.engine.deepspeed_internals import load_cpu_adam_op

    load_cpu_adam_op()
    torch.set_num_threads(threads)
    hyper: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    makers = {
        "DeepSpeedCPUAdam": lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **hyper),
        "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper),
        "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, fused=True, **hyper),
    }
    rows = []
    for name, make in makers.items():
        params = _parameters(n)
        optimizer = make(params)
        cpu, wall = cpu_and_wall(optimizer.step, torch.device("cpu"), repeats=3)
        rows.append(dict(optimizer=name, threads=threads, cpu_s=cpu, wall_s=wall,
                         elements_per_s_per_core=n / cpu))  # fmt: skip
        del optimizer, params
    return rows


def _nbytes(tensors: dict[int, torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def _collect(obj: Any, into: dict[int, torch.Tensor], depth: int = 0) -> None:
    """Every tensor under `obj` (attributes, lists, dicts, a tensor's .grad), keyed by storage."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            into.setdefault(obj.untyped_storage().data_ptr(), obj)
        if obj.grad is not None:
            _collect(obj.grad, into, depth + 1)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            _collect(key, into, depth + 1)
            _collect(value, into, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _collect(value, into, depth + 1)


def _rank(rank: int, world: int, port: int, offload: bool, device_type: str, out_dir: str) -> None:
    device = join_rank(rank, world, port, device_type)
    import glm53_ds
    from glm53_ds.engine import init_distributed
    from glm53_ds.model import Glm53Model
    from glm53_ds.parallel import init_layout
    from glm53_ds.transformer_config import make_transformer_config
    from tests.model_fixtures import CONFIG_A

    init_distributed()
    layout = init_layout(world, 1)
    cfg = glm53_ds.Glm53Config.from_text_dict(CONFIG_A)
    torch.manual_seed(0)
    model = Glm53Model(make_transformer_config(cfg, torch.bfloat16, expert_model_parallel_size=world),
                       mtp=True, pg_collection=layout.pg_collection).to(device, torch.bfloat16)  # fmt: skip
    zero: dict[str, Any] = {"stage": 1}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": zero, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}  # fmt: skip
    engine = glm53_ds.build_engine(model, config, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-4),
                                   layout=layout)  # fmt: skip
    ids = torch.randint(1, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(rank)).to(device)
    if device_type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    engine.backward(engine(ids, labels=ids))
    engine.step()
    zero_optimizer = engine.optimizer
    held: dict[int, torch.Tensor] = {}
    _collect(list(engine.module.parameters()) + list(engine.module.buffers()), held)
    _collect(list(vars(zero_optimizer).values()), held)
    _collect(list(zero_optimizer.optimizer.state.values()), held)
    host: dict[int, torch.Tensor] = {}
    if offload:  # what DeepSpeed's ZeRO-Offload keeps on the host
        _collect(zero_optimizer.single_partition_of_fp32_groups, host)
        _collect(list(zero_optimizer.optimizer.state.values()), host)
        _collect([v for k, v in vars(zero_optimizer).items() if "cpu" in k or "pinned" in k], host)
    result = dict(rank=rank, offload=offload, optimizer=type(zero_optimizer.optimizer).__name__,
                  held_MiB=_nbytes(held) / 2**20, host_MiB=_nbytes(host) / 2**20,
                  device_MiB=(_nbytes(held) - _nbytes(host)) / 2**20)  # fmt: skip
    if device_type == "cuda":
        torch.cuda.synchronize(device)
        result.update(device_MiB=torch.cuda.memory_allocated(device) / 2**20,
                      device_peak_MiB=torch.cuda.max_memory_allocated(device) / 2**20)  # fmt: skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    engine.close()


def device_state(offload: bool, device_type: str) -> dict[str, Any]:
    from glm53_ds.parallel.state import free_port

    world = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())  # EP = world: 2, or 1 on one GPU
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, free_port(), offload, device_type, out_dir), nprocs=world,
                           start_method="spawn")  # fmt: skip
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
                ranks.append(json.load(f))
    worst = max(ranks, key=lambda r: r["device_MiB"])
    return {k: v for k, v in worst.items() if k != "rank"}


def accumulation(micro: int) -> dict[str, float]:
    """The tiny model's gradients summed over `micro` micro-batches in bf16 and in fp32 (module docstring, 3)."""
    import glm53_ds
    from glm53_ds.training.presets import tiny

    torch.manual_seed(0)
    cfg = tiny()
    fp32 = glm53_ds.build_model(cfg)
    bf16 = glm53_ds.build_model(cfg)
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(torch.bfloat16)
    names = [n for n, p in fp32.named_parameters() if p.requires_grad and p.ndim >= 2]
    low, high = dict(bf16.named_parameters()), dict(fp32.named_parameters())
    sums = {kind: {n: torch.zeros_like(high[n]) for n in names} for kind in ("bf16", "fp32", "fp32 model")}
    for n in names:
        sums["bf16"][n] = sums["bf16"][n].bfloat16()
    g = torch.Generator().manual_seed(1)
    for _ in range(micro):
        ids = torch.randint(1, cfg.vocab_size, (2, 64), generator=g)
        for model in (bf16, fp32):
            model.zero_grad(set_to_none=True)
            (model(ids, labels=ids) / micro).backward()
        for n in names:
            grad = low[n].grad
            assert grad is not None and high[n].grad is not None
            sums["bf16"][n] += grad
            sums["fp32"][n] += grad.float()
            sums["fp32 model"][n] += high[n].grad

    def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        num = sum(float(((a[n].float() - b[n]) ** 2).sum()) for n in names)
        return (num / sum(float((b[n] ** 2).sum()) for n in names)) ** 0.5

    return dict(micro=micro, bf16_sum_vs_fp32_sum=rel(sums["bf16"], sums["fp32"]),
                bf16_sum_vs_fp32_model=rel(sums["bf16"], sums["fp32 model"]),
                fp32_sum_vs_fp32_model=rel(sums["fp32"], sums["fp32 model"]))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--micro", type=int, default=16, help="micro-batches summed (the recipes' 8-16)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    updates = host_update(args.params, 1) + [
        r for r in host_update(args.params, cores) if r["optimizer"] == "DeepSpeedCPUAdam"
    ]
    print(f"one AdamW step over {args.params / 1e6:.0f}M fp32 parameters on the host (medians of 3):")
    print_table(updates, ["optimizer", "threads", "cpu_s", "wall_s", "elements_per_s_per_core"])
    ds, foreach = updates[0], updates[1]
    ratio = ds["cpu_s"] / foreach["cpu_s"]
    states = [device_state(False, args.device), device_state(True, args.device)]
    print("\nthe tiny model at EP 2, bf16 ZeRO 1, two ranks, after one AdamW step (the larger rank):")
    print_table(states, ["offload", "optimizer", "held_MiB", "host_MiB", "device_MiB", "device_peak_MiB"])
    state_ratio = states[1]["device_MiB"] / states[0]["device_MiB"]
    summed = accumulation(args.micro)
    print(f"\nthe tiny model's gradients over {args.micro} micro-batches in bf16 (relative L2): the bf16 sum vs the fp32 "
          f"sum {summed['bf16_sum_vs_fp32_sum']:.4f}; against the fp32 model's, bf16 sum "
          f"{summed['bf16_sum_vs_fp32_model']:.4f}, fp32 sum {summed['fp32_sum_vs_fp32_model']:.4f}")  # fmt: skip
    path = write_results(f"cpu_adam_{args.device}", dict(
        device=device_description(torch.device("cpu")), params=args.params, cores=cores, host_update=updates,
        device_state=states, host_time_ratio_vs_torch=ratio, elements_per_s_per_core=ds["elements_per_s_per_core"],
        device_state_ratio=state_ratio, accumulation=summed))  # fmt: skip
    print(f"results: {path}")
    print(f"cpu_adam host_time_ratio_vs_torch={ratio:.3f} elements_per_s_per_core={ds['elements_per_s_per_core']:.3g} "
          f"device_state_ratio={state_ratio:.3f} bf16_accumulation_error={summed['bf16_sum_vs_fp32_sum']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
