"""Command line of `deepspeed launch/train.py`; `config.TrainConfig.from_args` turns it into the typed config."""

from __future__ import annotations

import argparse
import dataclasses

from .config import TrainConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed launch/train.py",
        argument_default=argparse.SUPPRESS,  # the defaults live in TrainConfig (appended to each help below)
        description="Train or fine-tune GLM-5.3-Flash with DeepSpeed ZeRO + expert parallelism. With no arguments: "
        "the `tiny` preset on the shipped text sample.",
    )
    p.add_argument("--config", help="a run described in a TOML file (tables named after the option groups below, "
                   "keys after the options; docs/usage.md); flags given beside it override it, each said in one line. "
                   "Every run writes its resolved options as <output-dir>/run.toml, which replays it")  # fmt: skip
    m = p.add_argument_group("model")
    m.add_argument("--hf-dir", help="start from a released checkpoint (config.json + safetensors); each rank reads "
                   "only the tensors it holds")  # fmt: skip
    m.add_argument("--model-config", help="a config.json, or a preset: tiny, glm-5.3-flash "
                   "(default: tiny, or --hf-dir's config)")  # fmt: skip
    m.add_argument("--mtp-loss-weight", type=float, help="default: the config's (0.3)")
    m.add_argument("--no-mtp", action="store_true", help="train without the MTP layer")
    m.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="activation recompute: selective = mHC pre/post + FFN; full = whole layers")  # fmt: skip
    m.add_argument("--aux-loss-coef", type=float, help="sequence-wise MoE balance loss weight (0 = off)")
    m.add_argument("--loss-chunk-mib", type=int, help="the LM / MTP loss runs over chunks of tokens whose fp32 "
                   "logits fit in this many MiB, never holding [tokens, vocab] logits; 0 = materialised logits")  # fmt: skip

    m.add_argument("--indexer-loss-coef", type=float, help="train the DSA indexers by a KL loss to the main "
                   "attention (DeepSeek-V3.2), weighted by this; 0 keeps them frozen, as the LM loss gives them no "
                   "gradient (docs/indexer_loss.md)")  # fmt: skip

    f = p.add_argument_group("fine-tuning")
    f.add_argument("--lora-rank", type=int, help="LoRA adapters of this rank on --lora-targets, the base frozen "
                   "(its router bias too: --router-bias-update-rate defaults to 0) (0: full fine-tuning)")  # fmt: skip
    f.add_argument(
        "--lora-alpha", type=float, help="the adapters' scale is alpha / rank (default: alpha = rank)"
    )
    f.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input")
    f.add_argument("--lora-targets", help="comma-separated: mla, kda, mlp, shared_expert, experts")
    f.add_argument("--trainable", help="regex of parameter names (native) that train; with LoRA besides the "
                   "adapters (e.g. 'indexer' with --indexer-loss-coef: an indexer-only warm-up)")  # fmt: skip
    f.add_argument("--freeze", help="regex of parameter names that stay frozen (applied last)")

    par = p.add_argument_group("parallelism")
    par.add_argument("--ep", type=int, help="expert parallel size")
    par.add_argument("--etp", type=int, help="expert tensor parallel size")
    par.add_argument("--sp", type=int, help="sequence parallel size: each sequence is split contiguously over "
                     "this many ranks, attention heads over the same ranks (Ulysses); must divide --seq-length "
                     "and both attention head counts (docs/parallelism.md)")  # fmt: skip

    d = p.add_argument_group("data")
    d.add_argument("--data", help="indexed dataset prefix (.bin/.idx), .jsonl or .txt; a .jsonl of chat "
                   "conversations ('messages' with system/user/assistant/tool turns, ShareGPT 'conversations', Alpaca "
                   "'instruction' + 'output', or 'prompt' + 'completion') trains on assistant tokens, packed "
                   "(default: data/tiny_corpus.txt)")  # fmt: skip
    d.add_argument("--pack", action="store_true", help="pack whole documents into rows of --seq-length tokens, "
                   "each computed alone (cu_seqlens), instead of windows over the document stream")  # fmt: skip
    d.add_argument("--long-documents", choices=["split", "truncate", "drop"], help="packed / chat data: a document "
                   "longer than --seq-length is split into row-sized pieces, cut to its first row, or left out; how "
                   "many were is reported at start-up (default: split)")  # fmt: skip
    d.add_argument("--valid-data", help="validation data in --data's formats (text, chat .jsonl, --pack): the LM "
                   "and MTP loss (global token mean, no gradients, dropout off) every --eval-interval steps and at "
                   "the end, in metrics.jsonl, TensorBoard and loss.png")  # fmt: skip
    d.add_argument("--valid-split", type=float, help="instead of --valid-data: hold out this fraction of --data's "
                   "samples (its last ones; at most 0.5) for validation; training reads the rest")  # fmt: skip
    d.add_argument("--eval-interval", type=int, help="steps between evaluations (0: at the end only)")
    d.add_argument("--eval-iters", type=int, help="global batches (of the training batch size) per evaluation; "
                   "the same samples every time")  # fmt: skip
    d.add_argument("--eval-at-start", action="store_true", help="also evaluate before the first step")
    d.add_argument("--tokenizer", help="'bytes' or a tokenizer directory (default: bytes for "
                   "presets, --hf-dir otherwise)")  # fmt: skip
    d.add_argument("--seq-length", type=int)
    d.add_argument("--micro-batch-size", type=int)
    d.add_argument("--global-batch-size", type=int, help="sequences per optimizer step over all "
                   "ranks (default: micro batch x world size)")  # fmt: skip
    d.add_argument("--seed", type=int)

    o = p.add_argument_group("optimization")
    o.add_argument("--train-iters", type=int)
    o.add_argument("--lr", type=float)
    o.add_argument("--min-lr", type=float, help="the cosine decay's floor (default: --lr / 10)")
    o.add_argument("--warmup", type=int, help="linear warmup steps, then cosine decay to --min-lr")
    o.add_argument("--weight-decay", type=float)
    o.add_argument("--no-decay-pattern", help="regex of parameter names without weight decay, in addition to "
                   "biases and 1-D parameters (norm weights, A_log, dt_bias, mHC base/scale)")  # fmt: skip
    o.add_argument("--clip-grad", type=float)
    o.add_argument("--router-bias-update-rate", type=float,
                   help="aux-loss-free balancing step; 0 turns it off (default: 1e-2 for the tiny preset, else 1e-3)")  # fmt: skip

    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--save", help="checkpoint directory")
    c.add_argument("--save-interval", type=int, help="steps between saves (0: only at the end)")
    c.add_argument("--load", help="resume from this checkpoint directory (its 'latest' tag)")
    c.add_argument("--load-tag", help="resume from this tag instead of 'latest' (e.g. step300)")
    c.add_argument("--load-model-only", action="store_true", help="take only --load's weights (at any layout): "
                   "fresh optimizer state, step 0, data from the start. Without it --load resumes everything, also "
                   "at another world size, EP, ETP, SP, ZeRO stage or dtype")  # fmt: skip
    c.add_argument("--save-into-existing", action="store_true", help="let a run that does not resume from --save "
                   "(--load the same directory) write there although it holds checkpoints: its tags of the same "
                   "names are replaced and 'latest' moves to this run's (refused without this)")  # fmt: skip
    c.add_argument("--export-hf", help="write a transformers-loadable directory at the end (with --hf-dir's "
                   "tokenizer files); refused if it exists and is not empty, unless --force")  # fmt: skip
    c.add_argument("--export-adapter", help="a LoRA run: write its adapters as a PEFT adapter at the end "
                   "(adapter_config.json + adapter_model.safetensors, transformers' glm5_next module names); "
                   "refused if it exists and is not empty, unless --force")  # fmt: skip
    c.add_argument("--force", action="store_true", help="let --export-hf / --export-adapter write into an existing non-empty directory: "
                   "the files it writes replace their namesakes, nothing is deleted")  # fmt: skip
    c.add_argument("--output-dir", help="metrics.jsonl and loss.png (default: runs/<model>)")
    c.add_argument("--check-replicas-interval", type=int, help="also before every save")
    c.add_argument("--log-interval", type=int)
    c.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak in TFLOP/s, for the MFU the log shows "
                   "(default: 989 on H100 / H200, 312 on A100, ...: by the GPU's name; none on CPU)")  # fmt: skip
    c.add_argument("--tensorboard-dir")
    c.add_argument("--wandb-project", help="also log the metrics to Weights & Biases (rank 0; pip install "
                   "\"glm53_ds[wandb]\")")  # fmt: skip
    c.add_argument("--wandb-mode", choices=["online", "offline"], help="offline: no network, the run is kept "
                   "under --output-dir for `wandb sync` (default: online)")  # fmt: skip
    c.add_argument("--wandb-name", help="the W&B run's name (default: W&B's)")
    c.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # set by the launcher

    pl = p.add_argument_group("planning")
    pl.add_argument("--gpus", type=int, help="the GPUs the run is planned for (`python -m glm53_ds.plan --config` "
                    "checks the description at this world; a run launched on another number says so)")  # fmt: skip
    pl.add_argument(
        "--gpu-memory", help="the memory of one GPU the plan is checked against (default: 141GB, an H200)"
    )

    ds = p.add_argument_group("DeepSpeed")
    ds.add_argument("--deepspeed_config", help="a DeepSpeed JSON config (ZeRO stage, bf16, ...); "
                    "batch sizes and clipping must agree with the command line (default: ds_configs' choice by device)")  # fmt: skip
    ds.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)  # accepted for compatibility
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for action in p._actions:
        documented = action.help == argparse.SUPPRESS or "default" in (action.help or "")
        if defaults.get(action.dest) not in (None, dataclasses.MISSING, False) and not documented:
            action.help = f"{action.help or ''} (default: {defaults[action.dest]})".strip()
    return p
