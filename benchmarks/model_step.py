"""Forward+backward of glm53_ds vs the transformers reference on the same config and weights.

For each sequence length: tokens/s and peak extra memory of one fwd+bwd step (loss on all tokens), both models
in one run, reported as ratios ours/HF. Peak memory: CUDA allocator peak on GPU, live tensor bytes on CPU.
The HF model is built in memory with random weights of realistic scale; glm53_ds loads them through the same
name mapping as a released checkpoint (`hf_loader.load_hf_state_into`).

Sizes (`--size`):
  tiny  hidden 64, 6 layers (the test config A's schedule): a CPU run in seconds.
  real  a slice of GLM-5.3-Flash at its real width: hidden 4096, hc_mult 4, 4 layers (KDA x3 + DSA; dense + MoE),
        the released KDA/indexer/MLP/expert dimensions, 16 experts (top-8) instead of 288, 8 MLA heads instead of
        64 (HF's eager attention materialises the [heads, s, s] scores) and a 32k vocabulary. For a GPU.

    python3 benchmarks/model_step.py [--size tiny|real] [--seq 512 2048] [--batch 1] [--dtype fp32|bf16]

Packed case (glm53_ds only): the same documents (seeded lengths between 1/16 and 1/4 of the longest sequence) as
one packed row with `cu_seqlens` vs a right-padded batch with an attention mask; tokens/s and peak memory as
ratios packed/padded.

Model FLOPs (glm53_ds/flops.py, docs/numerics.md) per step are printed before each length is measured, with the time
they take at the GPU's bf16 peak; each row gives TFLOP/s (and MFU on a known GPU). Host syncs and aten ops of one
glm53_ds step (`HostSyncCounter`, an untimed extra step) go to each row and, per
decoder layer / MTP depth / backward, to the JSON's summary.

`--compile`: a third model, glm53_ds under `glm53_ds.compile.apply_compile` (inductor: each decoder layer, the MTP
layer and the loss head), timed after its compiling step; each row gets process CPU time (1 thread) beside wall
time and, on CPU, the peak bytes torch's allocator held during the step (`alloc_MiB`, measure.allocator_peak_bytes:
it sees inductor's buffers, which the tensor count cannot, and does not depend on glibc's caching as the RSS does),
and the last line adds `compiled_time_ratio_vs_eager`, `compiled_mem_ratio_vs_eager` and
`compiled_time_ratio_vs_hf` (CPU time), and `compile_s` (the wall time of the compiling step). Sizes for it on CPU:
`tiny` and `medium` (hidden 512). Run it under glibc's default allocator: MALLOC_MMAP_THRESHOLD_=65536 slows
transformers' step more than ours (the tiny ratio vs transformers read 0.261x under it, 0.42x without). On CUDA
(gpu_check's `compile` step, `real` at 4k) the ratios are of synchronised wall time, and memory is the allocator's
peak, which sees inductor's buffers there.

Last line: `model_step time_ratio_vs_hf=<ours/HF> mem_ratio_vs_hf=<ours/HF> packed_time_ratio_vs_padded=...
packed_mem_ratio_vs_padded=...` at the longest sequence both models ran.
JSON goes to benchmarks/results/model_step_<device>[_<size>][_<dtype> when not the size's default][_compile].json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    allocator_peak_bytes,
    cpu_and_wall,
    device_description,
    peak_extra_bytes,
    print_table,
    synchronize,
    time_call,
    write_results,
)
from glm53_ds.compile import apply_compile  # noqa: E402
from glm53_ds.config import Glm53Config  # noqa: E402
from glm53_ds.flops import device_peak_tflops, step_flops  # noqa: E402
from glm53_ds.hf_loader import load_hf_state_into  # noqa: E402
from glm53_ds.host_syncs import HostSyncCounter  # noqa: E402
from tests.model_fixtures import CONFIG_A, perturb_  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(CONFIG_A, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, index_topk=64,
                 index_kpool=16, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4),
    "medium": dict(CONFIG_A, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, index_topk=64,
                   index_kpool=16, num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8,
                   linear_head_dim=64, q_lora_rank=256, kv_lora_rank=128),
    "real": dict(CONFIG_A, vocab_size=32768, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                 num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"],
                 indexer_types=["full"] * 4, mlp_layer_types=["dense"] + ["sparse"] * 3, n_routed_experts=16,
                 num_experts_per_tok=8, n_group=1, topk_group=1, num_attention_heads=8, num_key_value_heads=8,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_topk=2048,
                 index_kpool=16, index_head_dim=128, index_n_heads=32, linear_head_dim=128, linear_num_heads=64),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class InMemoryCheckpoint:
    """The reader interface `load_hf_state_into` uses, over an HF model's own state dict."""

    directory = "<in-memory HF model>"

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names if names is not None else self.state:
            yield name, self.state[name]


def build_pair(text: dict[str, Any], dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.hf_reference import VISION

    torch.manual_seed(0)
    hf_config = Glm5NextConfig(text_config=text, vision_config=VISION)
    with device:  # built where it runs: the real size has billions of parameters
        hf = Glm5NextForConditionalGeneration._from_config(hf_config, attn_implementation="eager")
    perturb_(hf)
    hf = hf.to(dtype=dtype)
    hf.config.use_cache = False
    ours = glm53_ds.build_model(Glm53Config.from_text_dict(text), dtype=dtype, mtp=False).to(device)
    load_hf_state_into(ours, InMemoryCheckpoint(hf.state_dict()), mtp=False)
    return hf.train(), ours.train()


def packed_vs_padded(ours: Any, vocab: int, total: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """One fwd+bwd over documents packed in one row vs the same documents as a padded batch."""
    g = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(max(2, total // 16), max(3, total // 4), (1,), generator=g)))
    lengths[-1] -= sum(lengths) - total
    lengths = [n for n in lengths if n > 0]
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    packed_ids = torch.cat(docs)[None].to(device)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    width = max(lengths)
    padded = torch.zeros(len(docs), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(docs), width, dtype=torch.bool, device=device)
    for i, d in enumerate(docs):
        padded[i, : len(d)], mask[i, : len(d)] = d.to(device), True
    labels = padded.masked_fill(~mask, -100)
    steps = {
        "packed": lambda: ours(packed_ids, labels=packed_ids, cu_seqlens=cu).backward(),
        "padded": lambda: ours(padded, attention_mask=mask, labels=labels).backward(),
    }
    out: dict[str, Any] = dict(documents=len(docs), tokens=total, padded_shape=list(padded.shape))
    for name, step in steps.items():
        out[f"{name}_step_s"] = time_call(step, device, warmup=1, repeats=repeats)
        out[f"{name}_peak_MiB"] = peak_extra_bytes(step, list(ours.parameters())) / 2**20
        ours.zero_grad(set_to_none=True)
    out["time_ratio"] = out["packed_step_s"] / out["padded_step_s"]
    out["mem_ratio"] = out["packed_peak_MiB"] / out["padded_peak_MiB"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--seq", type=int, nargs="*", default=None, help="default: 512 2048 (tiny), 4096 16384 (real)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 (tiny), bf16 (medium, real)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also glm53_ds compiled (inductor), see above")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"],
                        help="torch.compile's backend for --compile (aot_eager: the same graphs, no generated code; "
                        "gpu_check's CPU dry run)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype_name = args.dtype or ("fp32" if args.size == "tiny" else "bf16")
    seqs = args.seq or ([512, 2048] if args.size == "tiny" else [4096, 16384])
    text = SIZES[args.size]
    hf, ours = build_pair(text, DTYPES[dtype_name], device)
    models = {"hf": hf, "glm53_ds": ours}
    if args.compile:  # the same weights, compiled by region
        compiled = glm53_ds.build_model(Glm53Config.from_text_dict(text), dtype=DTYPES[dtype_name], mtp=False)
        compiled.to(device).load_state_dict(ours.state_dict())
        apply_compile(compiled.train(), backend=args.compile_backend)
        models["glm53_ds_compiled"] = compiled

    rows = []
    counts: dict[int, Any] = {}  # host syncs and aten ops per step, by scope (glm53_ds/host_syncs.py)
    peak_tflops = device_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    for seq in seqs:
        # the FLOP model (glm53_ds/flops.py) of one step, printed before it is measured, with its time at the peak
        model_flops = (
            step_flops(Glm53Config.from_text_dict(text), seq, mtp=ours.mtp is not None).per_token
            * args.batch
            * seq
        )
        at_peak = (
            f", {model_flops / (peak_tflops * 1e12) * 1e3:.2f} ms at the {peak_tflops:g} TFLOP/s peak"
            if peak_tflops
            else ""
        )
        print(f"prediction, seq {seq}: {model_flops / 1e12:.4g} TFLOP per fwd+bwd step{at_peak}")
        ids = torch.randint(1, text["vocab_size"], (args.batch, seq), device=device)
        if seq == seqs[0]:  # the two models compute the same loss (else the timing compares different work)
            with torch.no_grad():
                hf_loss, our_loss = hf(input_ids=ids, labels=ids).loss, ours(ids, labels=ids)
            loss_rel_diff = abs(our_loss.item() - hf_loss.item()) / abs(hf_loss.item())
            print(
                f"loss: hf {hf_loss.item():.6f} glm53_ds {our_loss.item():.6f} (relative difference {loss_rel_diff:.1e})"
            )
        steps = {
            "hf": lambda ids=ids: hf(input_ids=ids, labels=ids).loss.backward(),
            "glm53_ds": lambda ids=ids: ours(ids, labels=ids).backward(),
        }
        if args.compile:
            steps["glm53_ds_compiled"] = lambda ids=ids: models["glm53_ds_compiled"](
                ids, labels=ids
            ).backward()
        for name, step in steps.items():
            model = models[name]
            row: dict[str, Any] = dict(model=name, seq=seq, batch=args.batch, dtype=dtype_name)
            try:
                if name == "glm53_ds_compiled":
                    print(f"compiling (seq {seq}) ...", flush=True)
                    begun = time.perf_counter()
                    step()  # the compiling step, untimed
                    synchronize(device)
                    row.update(compile_s=time.perf_counter() - begun)
                    print(f"compiled in {row['compile_s']:.1f} s", flush=True)
                cpu_s, seconds = cpu_and_wall(step, device, repeats=args.repeats)
                # on CPU inductor's buffers are not dispatched tensors (the allocator's record sees them); CUDA's
                # allocator sees all
                if name != "glm53_ds_compiled" or device.type == "cuda":
                    row.update(peak_MiB=peak_extra_bytes(step, list(model.parameters())) / 2**20)
                if device.type == "cpu":
                    row.update(alloc_MiB=allocator_peak_bytes(step) / 2**20)
                row.update(step_s=seconds, cpu_s=cpu_s, tokens_per_s=args.batch * seq / seconds,
                           tflops=model_flops / seconds / 1e12)  # fmt: skip
                if peak_tflops:
                    row.update(mfu=row["tflops"] / peak_tflops)
            except torch.OutOfMemoryError:
                row.update(error="out of memory")
            if name == "glm53_ds" and "step_s" in row:  # counted in a separate, untimed step
                with HostSyncCounter(ours) as counter:
                    step()
                row.update(host_syncs=counter.total_syncs, aten_ops=counter.total_ops)
                counts[seq] = counter.summary()
            model.zero_grad(set_to_none=True)
            rows.append(row)
    packed = packed_vs_padded(ours, text["vocab_size"], max(seqs), device, args.repeats)
    print(f"packed vs padded ({packed['documents']} documents, {packed['tokens']} tokens, padded batch "
          f"{packed['padded_shape']}): time {packed['time_ratio']:.3f}, memory {packed['mem_ratio']:.3f}")  # fmt: skip
    print(f"device: {device_description(device)}")
    print_table(rows, ["model", "seq", "batch", "dtype", "step_s", "cpu_s", "tokens_per_s", "tflops", "mfu",
                       "peak_MiB", "alloc_MiB", "compile_s", "host_syncs", "aten_ops", "error"])  # fmt: skip
    both = [s for s in seqs if all("step_s" in r for r in rows if r["seq"] == s)]
    summary: dict[str, Any] = dict(
        size=args.size, loss_rel_diff=loss_rel_diff, packed=packed, host_syncs=counts
    )
    if both:
        by = {r["model"]: r for r in rows if r["seq"] == max(both)}
        summary.update(seq=max(both), time_ratio_vs_hf=by["glm53_ds"]["step_s"] / by["hf"]["step_s"],
                       mem_ratio_vs_hf=by["glm53_ds"]["peak_MiB"] / by["hf"]["peak_MiB"])  # fmt: skip
        if "glm53_ds_compiled" in by:
            fast, eager = by["glm53_ds_compiled"], by["glm53_ds"]
            # CPU: process time (1 thread) and the allocator's recorded peak; CUDA: synchronised wall time and the
            # allocator's peak
            clock, held = ("cpu_s", "alloc_MiB") if device.type == "cpu" else ("step_s", "peak_MiB")
            summary.update(compiled_time_ratio_vs_eager=fast[clock] / eager[clock],
                           compiled_time_ratio_vs_hf=fast[clock] / by["hf"][clock],
                           compiled_mem_ratio_vs_eager=fast[held] / eager[held], compile_s=fast["compile_s"])  # fmt: skip
    default_dtype = "fp32" if args.size == "tiny" else "bf16"
    suffix = ("" if args.size == "tiny" else f"_{args.size}") + (
        "" if dtype_name == default_dtype else f"_{dtype_name}"
    )
    suffix += "_compile" if args.compile else ""
    path = write_results(
        f"model_step_{device.type}{suffix}",
        dict(device=device_description(device), config=text, rows=rows, summary=summary),
    )
    print(f"results: {path}")
    if not both:
        print("model_step no sequence length ran in both models")
        return
    print(
        f"model_step time_ratio_vs_hf={summary['time_ratio_vs_hf']:.3f} mem_ratio_vs_hf={summary['mem_ratio_vs_hf']:.3f}"
        f" seq={summary['seq']} packed_time_ratio_vs_padded={packed['time_ratio']:.3f}"
        f" packed_mem_ratio_vs_padded={packed['mem_ratio']:.3f}"
        + "".join(
            f" {k}={summary[k]:.3f}"
            for k in (
                "compiled_time_ratio_vs_eager",
                "compiled_mem_ratio_vs_eager",
                "compiled_time_ratio_vs_hf",
                "compile_s",
            )
            if k in summary
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
