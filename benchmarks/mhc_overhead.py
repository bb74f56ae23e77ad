"""mHC overhead: one train step of GLM-5.3 layers with hc_mult=4 hyper-connections vs the same layers as a plain
pre-norm residual (no streams), same sizes and weights otherwise, in one run.

    python3 benchmarks/mhc_overhead.py [--seq 1024] [--batch 1] [--hidden 256] [--layers 4] [--dtype fp32|bf16]

KDA heads are 32 wide on CPU-sized runs and 128 wide (the released width) from hidden 1024 up; 1 in 4 layers is
DSA/MLA (4 heads), the first layer's FFN is dense and the rest are MoE (8 experts, top 2).

Last line: `mhc_overhead time_ratio=<mHC / plain> mem_ratio=<mHC / plain>`; JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from benchmarks.measure import device_description, peak_extra_bytes, print_table, time_call, write_results  # noqa: E402
from glm53_ds.config import Glm53Config  # noqa: E402
from glm53_ds.mhc import hc_head, unpack_streams  # noqa: E402
from glm53_ds.specs import get_glm53_block_spec  # noqa: E402
from glm53_ds.transformer_config import make_transformer_config  # noqa: E402


def build(cfg: Glm53Config, with_mhc: bool, device: torch.device, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec = get_glm53_block_spec(cfg)
    if not with_mhc:
        for layer in spec.layer_specs:
            layer.submodules.attn_hc = None
            layer.submodules.ffn_hc = None
            layer.params = {k: v for k, v in layer.params.items() if k != "expands_streams"}
    torch.manual_seed(0)
    with device:
        return TransformerBlock(make_transformer_config(cfg, dtype), spec, post_layer_norm=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    n = args.layers
    kda_head = 128 if args.hidden >= 1024 else 32
    cfg = Glm53Config(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=n, layer_types=["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1), indexer_types=["full"] * n, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4, qk_nope_head_dim=32,
        v_head_dim=32, index_topk=256, index_kpool=16, index_head_dim=32, index_n_heads=2, linear_head_dim=kda_head,
        linear_num_heads=args.hidden // kda_head, n_routed_experts=8, num_experts_per_tok=2, hc_mult=4,
    )  # fmt: skip
    glm53_ds.build_model(cfg.replace(num_hidden_layers=1, layer_types=cfg.layer_types[:1], mlp_layer_types=["dense"],
                                     indexer_types=["full"]))  # process groups  # fmt: skip
    x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=dtype)
    mask = torch.ones(args.batch, args.seq, dtype=torch.bool, device=device)
    rows = []
    for name, with_mhc in (("plain residual", False), ("mHC hc_mult=4", True)):
        block = build(cfg, with_mhc, device, dtype)

        def step(block=block, with_mhc=with_mhc) -> None:
            out = block(
                x, attention_mask=mask
            )  # with mHC: the first layer expands, the streams come out packed
            (
                hc_head(unpack_streams(out, cfg.hc_mult)) if with_mhc else out
            ).float().square().mean().backward()

        seconds = time_call(step, device, warmup=1, repeats=3)
        peak = peak_extra_bytes(step, list(block.parameters()))
        rows.append(dict(model=name, seq=args.seq, hidden=args.hidden, layers=n, dtype=args.dtype, step_s=seconds,
                         tokens_per_s=args.seq * args.batch / seconds, peak_MiB=peak / 2**20))  # fmt: skip
    print(f"device: {device_description(device)}")
    print_table(rows, ["model", "seq", "hidden", "layers", "dtype", "step_s", "tokens_per_s", "peak_MiB"])
    summary = dict(
        time_ratio=rows[1]["step_s"] / rows[0]["step_s"], mem_ratio=rows[1]["peak_MiB"] / rows[0]["peak_MiB"]
    )
    path = write_results(
        f"mhc_overhead_{device.type}", dict(device=device_description(device), rows=rows, summary=summary)
    )
    print(f"results: {path}")
    print(f"mhc_overhead time_ratio={summary['time_ratio']:.3f} mem_ratio={summary['mem_ratio']:.3f}")


if __name__ == "__main__":
    main()
