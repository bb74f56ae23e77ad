"""Peak memory of the LM loss head at GLM-5.3's real vocabulary: chunked linear cross-entropy vs materialised logits
vs transformers' own loss.

A tiny-width GLM-5.3 (hidden 32, KDA + DSA layers, dense + MoE) with vocab_size 154880, one fwd+bwd of the loss
over `--tokens` tokens (default 4096), for
  (a) glm53_ds's chunked head (`loss_chunk_bytes`, default 256 MiB),
  (b) glm53_ds with the materialised [tokens, vocab] fp32 logits (`loss_chunk_bytes=0`),
  (c) transformers' `Glm5NextForConditionalGeneration(..., labels=...)`,
all with the same weights. Peak memory: on CPU each path runs in its own process and its resident set is sampled
(`measure.PeakRss`, MALLOC_MMAP_THRESHOLD_=65536 so that RSS follows what is held); on CUDA
`torch.cuda.max_memory_allocated` in one process. Time: the fwd+bwd, best of `--repeats`.

    python3 benchmarks/head_memory.py [--tokens 4096] [--device cpu|cuda]

Last line: `head_memory ratio_vs_materialised=<a/b> ratio_vs_hf=<a/c> time_ratio_vs_materialised=<t(a)/t(b)>`;
JSON in benchmarks/results/head_memory_<device>.json. Goal: both memory ratios <= 0.3, the time ratio <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import PeakRss, device_description, print_table, synchronize, write_results  # noqa: E402
from tests.model_fixtures import CONFIG_A  # noqa: E402

VOCAB = 154880
TEXT = dict(CONFIG_A, vocab_size=VOCAB, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
            indexer_types=["full", "full"], mlp_layer_types=["dense", "sparse"])  # fmt: skip
PATHS = ("chunked", "materialised", "hf")


def build(path: str, device: torch.device) -> Any:
    """The model of one path, weights shared by seed (the HF model's, loaded into glm53_ds by name)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    import glm53_ds
    from benchmarks.model_step import InMemoryCheckpoint
    from glm53_ds.hf_loader import load_hf_state_into
    from tests.hf_reference import VISION
    from tests.model_fixtures import perturb_

    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION))
    perturb_(hf, 0)
    if path == "hf":
        hf.config.text_config._attn_implementation = "eager"
        return hf.to(device).train()
    cfg = glm53_ds.Glm53Config.from_text_dict(TEXT)
    ours = glm53_ds.build_model(cfg, mtp=False, **({"loss_chunk_bytes": 0} if path == "materialised" else {}))
    load_hf_state_into(ours, InMemoryCheckpoint(hf.state_dict()), mtp=False)
    del hf
    return ours.to(device).train()


def step_fn(path: str, model: Any, ids: torch.Tensor) -> Any:
    if path == "hf":
        return lambda: model(input_ids=ids, labels=ids).loss.backward()
    return lambda: model(ids, labels=ids).backward()


def measure_one(path: str, tokens: int, device: torch.device, repeats: int) -> dict[str, Any]:
    model = build(path, device)
    ids = torch.randint(1, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    step = step_fn(path, model, ids)
    if device.type == "cuda":
        step()  # warm-up
        model.zero_grad(set_to_none=True)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with PeakRss() as rss:
            step()
        peak = rss.extra
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return dict(path=path, tokens=tokens, peak_MiB=peak / 2**20, step_s=min(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--one", choices=PATHS, help=argparse.SUPPRESS
    )  # a CPU child process: one path, JSON out
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.one:
        print(json.dumps(measure_one(args.one, args.tokens, device, args.repeats)))
        return
    rows = []
    for path in PATHS:
        if device.type == "cuda":
            rows.append(measure_one(path, args.tokens, device, args.repeats))
            torch.cuda.empty_cache()
            continue
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        cmd = [sys.executable, os.path.abspath(__file__), "--one", path, "--tokens", str(args.tokens),
               "--device", "cpu", "--repeats", str(args.repeats)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by = {r["path"]: r for r in rows}
    summary = dict(
        ratio_vs_materialised=by["chunked"]["peak_MiB"] / by["materialised"]["peak_MiB"],
        ratio_vs_hf=by["chunked"]["peak_MiB"] / by["hf"]["peak_MiB"],
        time_ratio_vs_materialised=by["chunked"]["step_s"] / by["materialised"]["step_s"],
    )
    print(
        f"device: {device_description(device)}; vocab {VOCAB}, {args.tokens} tokens, hidden {TEXT['hidden_size']}"
    )
    print_table(rows, ["path", "tokens", "peak_MiB", "step_s"])
    path = write_results(f"head_memory_{device.type}", dict(device=device_description(device), rows=rows,
                                                          summary=summary))  # fmt: skip
    print(f"results: {path}")
    print(
        f"head_memory ratio_vs_materialised={summary['ratio_vs_materialised']:.3f} "
        f"ratio_vs_hf={summary['ratio_vs_hf']:.3f} time_ratio_vs_materialised={summary['time_ratio_vs_materialised']:.3f}"
    )


if __name__ == "__main__":
    main()
