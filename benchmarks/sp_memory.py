"""Peak memory per rank of one training step under sequence parallelism: SP = 1, 2, 4 in one run.

A tiny-width GLM-5.3 (hidden 32, four heads of each attention kind, KDA + DSA layers with a shared selection, dense
+ MoE, one MTP layer) runs one training step (forward, backward, SGD update) on one sequence of `--tokens` tokens
(default 16384), split over SP ranks (world = SP; gloo on CPU, NCCL on CUDA). Every SP size is a fresh set of
processes; each rank measures its own peak: on CPU the resident set over its value before the step
(`measure.PeakRss`, MALLOC_MMAP_THRESHOLD_=65536 so that RSS follows what is held), on CUDA
`torch.cuda.max_memory_allocated` over the memory held before the step. The largest rank's peak counts.

    python3 benchmarks/sp_memory.py [--tokens 16384] [--device cpu|cuda] [--sp 1 2 4]

On CUDA an SP size needs that many visible GPUs; sizes that do not fit are reported as skipped.
Last line: `sp_memory ratio_sp2=<peak SP2 / SP1> ratio_sp4=<peak SP4 / SP1>`; JSON in
benchmarks/results/sp_memory_<device>.json. Goal: <= 0.6 and <= 0.35.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import PeakRss, device_description, join_rank, print_table, write_results  # noqa: E402
from tests.model_fixtures import CONFIG_A  # noqa: E402

TEXT = dict(CONFIG_A, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4,
            num_nextn_predict_layers=1)  # fmt: skip


def _rank(rank: int, world: int, port: int, tokens: int, device_type: str, out_dir: str) -> None:
    device = join_rank(rank, world, port, device_type)
    import torch.distributed as dist

    import glm53_ds
    from glm53_ds.model import Glm53Model
    from glm53_ds.parallel import init_layout
    from glm53_ds.transformer_config import make_transformer_config

    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    layout = init_layout(1, 1, sp=world)
    cfg = glm53_ds.Glm53Config.from_text_dict(TEXT)
    torch.manual_seed(0)
    model = Glm53Model(
        make_transformer_config(cfg, torch.float32), mtp=True, pg_collection=layout.pg_collection
    )
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(1, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> None:
        model(ids, labels=ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    dist.barrier()
    start = time.perf_counter()
    if device_type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with PeakRss() as rss:
            step()
        peak = rss.extra
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(dict(peak_MiB=peak / 2**20, step_s=seconds), f)
    dist.barrier()
    dist.destroy_process_group()


def measure(sp: int, tokens: int, device_type: str) -> dict[str, Any]:
    from glm53_ds.parallel.state import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
        mp.start_processes(_rank, args=(sp, free_port(), tokens, device_type, out_dir), nprocs=sp,
                           start_method="spawn")  # fmt: skip
        ranks = []
        for r in range(sp):
            with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
                ranks.append(json.load(f))
    return dict(sp=sp, tokens=tokens, tokens_per_rank=tokens // sp,
                peak_MiB=max(r["peak_MiB"] for r in ranks), step_s=max(r["step_s"] for r in ranks))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if 1 not in args.sp:
        parser.error("--sp must include 1 (the ratios are against SP = 1)")
    device = torch.device(args.device)
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    rows, skipped = [], []
    for sp in args.sp:
        if gpus is not None and sp > gpus:
            skipped.append(sp)
            continue
        rows.append(measure(sp, args.tokens, args.device))
    by = {r["sp"]: r for r in rows}
    ratios = {f"ratio_sp{sp}": by[sp]["peak_MiB"] / by[1]["peak_MiB"] for sp in by if sp != 1}
    print(f"device: {device_description(device)}; one training step of {args.tokens} tokens, hidden "
          f"{TEXT['hidden_size']}, {TEXT['num_hidden_layers']} layers + MTP; peak of the largest rank")  # fmt: skip
    print_table(rows, ["sp", "tokens_per_rank", "peak_MiB", "step_s"])
    if skipped:
        print(f"skipped (more ranks than the {gpus} visible GPU(s)): SP = {skipped}")
    path = write_results(f"sp_memory_{device.type}", dict(device=device_description(device), rows=rows,
                                                        ratios=ratios, skipped=skipped))  # fmt: skip
    print(f"results: {path}")
    shown = " ".join(f"ratio_sp{sp}={ratios[f'ratio_sp{sp}']:.3f}" if f"ratio_sp{sp}" in ratios
                     else f"ratio_sp{sp}=skipped" for sp in args.sp if sp != 1)  # fmt: skip
    print(f"sp_memory {shown}")


if __name__ == "__main__":
    main()
