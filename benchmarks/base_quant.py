"""`--base-quant none` vs `fp8` on the same FP8 checkpoint, in one run: the bytes the frozen block-FP8 weights hold,
the peak of one LoRA step, and the step's time (the cost of dequantising tile by tile inside the GEMMs).

A medium-width model (hidden 512, 16 routed experts of 512, top-4, a shared expert, one dense MLP of 1024; three
layers: KDA, MLA with the DSA indexer, KDA; MTP) is saved as transformers does, then as the FP8 release stores it
(`tests/model_fixtures.save_fp8_copy`: routed, shared and dense MLP weights in float8_e4m3fn, 128 x 128 blocks),
and loaded from that one FP8 checkpoint both ways in bf16: `none` dequantises at load, `fp8` keeps the weights as
stored. LoRA rank 16 on every target; one step = forward + backward of one row of each `--tokens` count (the optimizer's update is
the same for both: the adapters only). CPU, one thread, process CPU time and wall time, medians of `--repeats`.

Memory: `frozen_fp8_kinds_bytes` = the bytes of the weights the checkpoint stores in FP8 as the model holds them
(bf16 for `none`; FP8 + fp32 block scales for `fp8`); `step_peak_bytes` = the peak of tensors a step allocates
beyond the model (`measure.peak_extra_bytes`), per `--tokens`, for `fp8` plus one expert's dequantised tile (the custom op's own
temporary, invisible to the counter; an upper bound); `model_bytes` = every parameter and buffer. The losses of
the two are compared (they are the same computation: `loss_max_abs_diff` is 0 on CPU).

    python3 benchmarks/base_quant.py [--tokens 512 2048] [--repeats 3]

Last line: `base_quant experts_bytes_ratio=… step_peak_ratio_<tokens>=… step_time_ratio_<tokens>=… …` (fp8 / none;
goal: experts ≤ 0.52). JSON: benchmarks/results/base_quant_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    cpu_and_wall,
    device_description,
    peak_extra_bytes,
    print_table,
    write_results,
)
from glm53_ds.layers.block_fp8 import is_block_fp8  # noqa: E402
from glm53_ds.layers.lora import LoraSpec  # noqa: E402
from glm53_ds.layers.lora_targets import apply_lora  # noqa: E402
from glm53_ds.training.trainable import select_trainable  # noqa: E402
from tests.model_fixtures import CONFIG_A, save_fp8_copy, save_tiny_hf  # noqa: E402

MEDIUM: dict[str, Any] = dict(
    CONFIG_A, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=3,
    layer_types=["linear_attention", "indexed_attention", "linear_attention"], indexer_types=["full"] * 3,
    mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=16, num_experts_per_tok=4, n_group=1,
    topk_group=1, index_topk=64, index_kpool=4,
)  # fmt: skip
BLOCK = (128, 128)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fp8_kind_bytes(model: torch.nn.Module, fp8_names: set[str]) -> int:
    """Bytes of the weights stored in FP8 by the checkpoint, as `model` holds them (their scales included)."""
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        base = name.removesuffix("_scale_inv")
        if base in fp8_names:
            total += tensor.numel() * tensor.element_size()
    return total


def measure(
    path: str, base_quant: str, tokens: list[int], repeats: int, fp8_names: set[str] | None
) -> tuple[dict[str, Any], set[str]]:
    torch.manual_seed(0)
    model = glm53_ds.load_hf(path, dtype=torch.bfloat16, base_quant=base_quant)
    apply_lora(model, LoraSpec(rank=16, alpha=32))
    select_trainable(model, lora=True, trainable=None, freeze=None, train_indexer=False)
    if fp8_names is None:  # the fp8 model names its block-FP8 weights
        fp8_names = {n for n, b in model.named_buffers() if is_block_fp8(b)}
    tile = 0
    if base_quant == "fp8":  # the op's own temporary: one expert's (or linear's) weight dequantised to bf16
        tile = max(b[0].numel() * 2 for n, b in model.named_buffers() if is_block_fp8(b))
    params = [*model.parameters(), *model.buffers()]
    out: dict[str, Any] = dict(base_quant=base_quant, frozen_fp8_kinds_bytes=_fp8_kind_bytes(model, fp8_names),
                               model_bytes=_nbytes(params))  # fmt: skip
    for n in tokens:
        ids = torch.randint(1, model.glm.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
        losses: list[float] = []

        def step(ids: torch.Tensor = ids, losses: list[float] = losses) -> None:
            loss = model(ids, labels=ids)
            loss.backward()
            losses.append(loss.item())
            model.zero_grad(set_to_none=True)

        cpu, wall = cpu_and_wall(step, torch.device("cpu"), repeats)
        peak = peak_extra_bytes(step, [ids])
        out[n] = dict(step_peak_bytes=peak + tile, cpu_s=cpu, wall_s=wall, loss=losses[0])
    return out, fp8_names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf(os.path.join(tmp, "bf16"), MEDIUM)
        fp8 = str(save_fp8_copy(os.path.join(tmp, "bf16"), os.path.join(tmp, "fp8"), BLOCK))
        kept, names = measure(fp8, "fp8", args.tokens, args.repeats, None)
        dense, _ = measure(fp8, "none", args.tokens, args.repeats, names)
    rows = [dict(base_quant=m["base_quant"], tokens=n, frozen_fp8_kinds_bytes=m["frozen_fp8_kinds_bytes"],
                 model_bytes=m["model_bytes"], **m[n]) for n in args.tokens for m in (dense, kept)]  # fmt: skip
    print_table(rows, ["base_quant", "tokens", "frozen_fp8_kinds_bytes", "model_bytes", "step_peak_bytes", "cpu_s",
                       "wall_s", "loss"])  # fmt: skip
    ratios: dict[str, float] = dict(
        experts_bytes_ratio=kept["frozen_fp8_kinds_bytes"] / dense["frozen_fp8_kinds_bytes"],
        model_bytes_ratio=kept["model_bytes"] / dense["model_bytes"],
    )
    for n in args.tokens:
        ratios[f"step_peak_ratio_{n}"] = kept[n]["step_peak_bytes"] / dense[n]["step_peak_bytes"]
        ratios[f"step_time_ratio_{n}"] = kept[n]["cpu_s"] / dense[n]["cpu_s"]
        ratios[f"step_wall_ratio_{n}"] = kept[n]["wall_s"] / dense[n]["wall_s"]
        ratios[f"loss_max_abs_diff_{n}"] = abs(kept[n]["loss"] - dense[n]["loss"])
    path = write_results("base_quant_cpu", dict(device=device_description(torch.device("cpu")), tokens=args.tokens,
                                                repeats=args.repeats, config=MEDIUM, block=list(BLOCK),
                                                none={str(k): v for k, v in dense.items()},
                                                fp8={str(k): v for k, v in kept.items()}, **ratios))  # fmt: skip
    print(f"results: {path}")
    print("base_quant " + " ".join(f"{k}={v:.4g}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
