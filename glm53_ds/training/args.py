"""Command line of `deepspeed launch/train.py` (DeepSpeed's own `--deepspeed_config` included)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed launch/train.py",
        description="Train or fine-tune GLM-5.3-Flash with DeepSpeed ZeRO + expert parallelism. With no arguments: "
        "the `tiny` preset on the shipped text sample.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--hf-dir", help="start from a released checkpoint (config.json + safetensors); each rank reads "
                   "only the tensors it holds")  # fmt: skip
    m.add_argument("--model-config", default=None, help="a config.json, or a preset: tiny, glm-5.3-flash "
                   "(default: tiny, or --hf-dir's config)")  # fmt: skip
    m.add_argument("--mtp-loss-weight", type=float, default=None, help="default: the config's (0.3)")
    m.add_argument("--no-mtp", action="store_true", help="train without the MTP layer")
    m.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recompute: selective = mHC pre/post + FFN; full = whole layers")  # fmt: skip
    m.add_argument(
        "--aux-loss-coef", type=float, default=0.0, help="sequence-wise MoE balance loss weight (0 = off)"
    )

    par = p.add_argument_group("parallelism")
    par.add_argument("--ep", type=int, default=1, help="expert parallel size")
    par.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")

    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, help="indexed dataset prefix (.bin/.idx), .jsonl or .txt "
                   "(default: data/tiny_corpus.txt)")  # fmt: skip
    d.add_argument("--tokenizer", default=None, help="'bytes' or a tokenizer directory (default: bytes for "
                   "presets, --hf-dir otherwise)")  # fmt: skip
    d.add_argument("--seq-length", type=int, default=64)
    d.add_argument("--micro-batch-size", type=int, default=2)
    d.add_argument("--global-batch-size", type=int, default=None, help="sequences per optimizer step over all "
                   "ranks (default: micro batch x world size)")  # fmt: skip
    d.add_argument("--seed", type=int, default=1234)

    o = p.add_argument_group("optimization")
    o.add_argument("--train-iters", type=int, default=60)
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--min-lr", type=float, default=3e-4)
    o.add_argument("--warmup", type=int, default=5, help="linear warmup steps, then cosine decay to --min-lr")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--router-bias-update-rate", type=float, default=None,
                   help="aux-loss-free balancing step; 0 turns it off (default: 1e-2 for the tiny preset, else 1e-3)")  # fmt: skip

    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--save", default=None, help="checkpoint directory")
    c.add_argument("--save-interval", type=int, default=0, help="steps between saves (0: only at the end)")
    c.add_argument("--load", default=None, help="resume from this checkpoint directory (its 'latest' tag)")
    c.add_argument("--load-tag", default=None, help="resume from this tag instead of 'latest' (e.g. step300)")
    c.add_argument("--export-hf", default=None, help="write a transformers-loadable directory at the end")
    c.add_argument("--output-dir", default=None, help="metrics.jsonl and loss.png (default: runs/<model>)")
    c.add_argument("--check-replicas-interval", type=int, default=0, help="also before every save")
    c.add_argument("--log-interval", type=int, default=10)
    c.add_argument("--tensorboard-dir", default=None)
    c.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)

    import deepspeed

    return deepspeed.add_config_arguments(p)
