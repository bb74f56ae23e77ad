"""`TrainConfig`: the run's typed description, every option declared once and resolved once.

Each field is an option (training/options.py): its section, help, choices, least value and what the planner does
with it; the command line (`deepspeed launch/train.py`), the run file (`--config run.toml`) and the planner's flags
are generated from them. This module declares; training/option_checks.py (which imports it, never the other way)
resolves the defaults that follow the model and runs the checks that need no process group (`resolve_config`), each
a `SetupError` naming the option. Checks that need the world size (layout, batch sizes) run in the trainer's set-up,
still before the model is built.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ..config import Glm53Config
from ..layers.lora import LORA_TARGETS, LoraSpec
from .errors import SetupError
from .options import MEMORY, SEARCHED, option
from .packing import LONG_DOCUMENTS
from .presets import DEFAULT_ROUTER_BIAS_UPDATE_RATE

__all__ = ["RECOMPUTE", "SetupError", "TrainConfig", "check_seq_length", "recompute_overrides"]

RECOMPUTE = ("none", "selective", "full")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(REPO_ROOT, "data", "tiny_corpus.txt")
# the sections: the command line's argument groups, the run file's tables (model, fine_tuning, ...)
MODEL, FINE_TUNING, PARALLELISM, DATA = "model", "fine-tuning", "parallelism", "data"
BASE_QUANT = ("auto", "none", "fp8")
COMPILE_BACKENDS = ("inductor", "aot_eager")
EXPORT_FORMATS = ("dense", "fp8")
OPTIMIZATION, OUTPUT, PLANNING, DEEPSPEED = "optimization", "checkpoints and output", "planning", "DeepSpeed"


def recompute_overrides(mode: str) -> dict[str, Any]:
    """The transformer-config fields of a `--recompute` mode: selective recomputes the mHC mixes and the MLP / MoE
    in backward; full recomputes each whole layer (megatron's uniform method, one layer per checkpoint)."""
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp", "moe"])
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if mode != "none":
        raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {mode!r}")
    return {}


def check_seq_length(seq_length: int, cfg: Glm53Config) -> None:
    """A row longer than the model's positions is refused, by the trainer, the planner and the dry run alike."""
    if seq_length > cfg.max_position_embeddings:
        raise SetupError(f"--seq-length {seq_length} is above the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings} (its config); raise that in the config to train longer "
                         "rows")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """Every option of a run, declared once (training/options.py): the command line and the run file's tables are
    generated from these fields, by section."""

    # ---- model
    hf_dir: str | None = option(None, MODEL, "start from a released checkpoint (config.json + safetensors); each "
                                "rank reads only the tensors it holds", plan=MEMORY)  # fmt: skip
    model_config: str | None = option(None, MODEL, "a config.json, or a preset: tiny, glm-5.3-flash (default: "
                                      "tiny, or --hf-dir's config)", plan=MEMORY)  # fmt: skip
    mtp_loss_weight: float | None = option(None, MODEL, "default: the config's (0.3)", least=0)
    no_mtp: bool = option(False, MODEL, "train without the MTP layer", plan=MEMORY)
    recompute: str = option("none", MODEL, "activation recompute: selective = mHC pre/post + FFN; full = whole "
                            "layers", choices=RECOMPUTE, plan=SEARCHED)  # fmt: skip
    offload_activations: bool = option(False, MODEL, "with --recompute full: each layer's kept inputs go to pinned "
                                       "host memory as they are produced and come back one layer ahead of the "
                                       "backward (the same losses and gradients; docs/usage.md)", plan=SEARCHED)  # fmt: skip
    moe_tile_mib: int = option(0, MODEL, "route and compute each MoE layer's tokens in tiles whose expert "
                               "activations fit in this many MiB, each tile recomputed in backward, so the MoE's "
                               "peak is one tile's; the dense MLPs, shared experts and mHC mixes tile within the same budget "
                               "(long rows; the same losses; 0: all tokens at once)", plan=MEMORY, least=0)  # fmt: skip
    compile: bool = option(False, MODEL, "torch.compile each decoder layer, the MTP layer and the loss head, by "
                           "region (one compiled code per layer kind, as torchtitan); the first step compiles "
                           "(minutes); the same losses within rounding. Off by default until measured on CUDA "
                           "(docs/usage.md)")  # fmt: skip
    compile_backend: str = option("inductor", MODEL, "torch.compile's backend under --compile (aot_eager: the "
                                  "same graphs, no generated code: checks a run quickly)",
                                  choices=COMPILE_BACKENDS)  # fmt: skip
    aux_loss_coef: float = option(
        0.0, MODEL, "sequence-wise MoE balance loss weight (0 = off)", plan=MEMORY, least=0
    )
    loss_chunk_mib: int = option(256, MODEL, "the LM / MTP loss runs over chunks of tokens whose fp32 logits fit "
                                 "in this many MiB, never holding [tokens, vocab] logits; 0 = materialised logits", plan=MEMORY, least=0)  # fmt: skip
    indexer_loss_coef: float = option(0.0, MODEL, "train the DSA indexers by a KL loss to the main attention "
                                      "(DeepSeek-V3.2), weighted by this; 0 keeps them frozen, as the LM loss gives "
                                      "them no gradient (docs/indexer_loss.md)", plan=MEMORY, least=0)  # fmt: skip
    # ---- fine-tuning: LoRA adapters and which parameters train
    base_quant: str = option("auto", FINE_TUNING, "how frozen weights the checkpoint stores in block-FP8 (the "
                             "released download's experts) are held: fp8 = resident as stored, dequantised tile "
                             "by tile inside the GEMMs (half the bytes; the same values); none = dequantised to the "
                             "model's dtype at load; auto = fp8 for a LoRA run on an FP8 checkpoint, else none",
                             choices=BASE_QUANT, plan=MEMORY)  # fmt: skip
    lora_rank: int = option(0, FINE_TUNING, "LoRA adapters of this rank on --lora-targets, the base frozen (its "
                            "router bias too: --router-bias-update-rate defaults to 0) (0: full fine-tuning)", plan=MEMORY, least=0)  # fmt: skip
    lora_alpha: float | None = option(None, FINE_TUNING, "the adapters' scale is alpha / rank (default: alpha = "
                                      "rank)")  # fmt: skip
    lora_dropout: float = option(0.0, FINE_TUNING, "dropout on the adapters' input", plan=MEMORY)
    lora_targets: str = option(",".join(LORA_TARGETS), FINE_TUNING, "comma-separated: mla, kda, mlp, "
                               "shared_expert, experts", plan=MEMORY)  # fmt: skip
    trainable: str | None = option(None, FINE_TUNING, "regex of parameter names (native) that train; with LoRA "
                                   "besides the adapters (e.g. 'indexer' with --indexer-loss-coef: an indexer-only "
                                   "warm-up)", plan=MEMORY)  # fmt: skip
    freeze: str | None = option(
        None, FINE_TUNING, "regex of parameter names that stay frozen (applied last)", plan=MEMORY
    )
    # ---- parallelism
    ep: int = option(1, PARALLELISM, "expert parallel size", plan=SEARCHED, least=1)
    etp: int = option(1, PARALLELISM, "expert tensor parallel size", plan=SEARCHED, least=1)
    sp: int = option(1, PARALLELISM, "sequence parallel size: each sequence is split contiguously over this many "
                     "ranks, attention heads over the same ranks (Ulysses); must divide --seq-length and both "
                     "attention head counts (docs/parallelism.md)", plan=SEARCHED, least=1)  # fmt: skip
    # ---- data
    data: tuple[str, ...] = option((DEFAULT_DATA,), DATA, "one or more sources, each PATH or PATH:WEIGHT, "
                                   "PATH[:SPLIT] for a dataset with splits: a .jsonl, .json, .parquet, .arrow or "
                                   ".csv file of rows, a folder or glob of such shards, a Dataset/DatasetDict."
                                   "save_to_disk folder, a hub dataset id in the local Hugging Face cache, an "
                                   "indexed dataset prefix (.bin/.idx) or a text file. Rows of chat conversations "
                                   "('messages' with system/user/assistant/tool turns, ShareGPT 'conversations', "
                                   "Alpaca 'instruction' + 'output', or 'prompt' + 'completion') train on "
                                   "assistant tokens, packed; 'text' rows are documents. Several are mixed by "
                                   "weight (a:3 b:1: 75%% of the samples from a), each in its own shape; an epoch "
                                   "is as many samples as they hold together (default: data/tiny_corpus.txt)")  # fmt: skip
    data_columns: tuple[str, ...] | None = option(None, DATA, "the columns of rows under other names: ROLE=COLUMN for "
                                           "every source that has COLUMN, SOURCE:ROLE=COLUMN for one --data "
                                           "entry (roles: messages, conversations, instruction, input, output, "
                                           "system, prompt, completion, text), e.g. messages=dialog")  # fmt: skip
    data_workers: int | None = option(None, DATA, "processes that tokenise --data into its cache (default: the "
                                      "CPU cores of one rank's share of the node)", least=1)  # fmt: skip
    data_cache: str | None = option(None, DATA, "where tokenised data is cached, keyed by content, tokenizer and "
                                    "columns, built once per file system (default: <--output-dir>/data_cache; "
                                    "`python -m glm53_ds.data prepare` fills it ahead of a run)")  # fmt: skip
    pack: bool = option(False, DATA, "pack whole documents into rows of --seq-length tokens, each computed alone "
                        "(cu_seqlens), instead of windows over the document stream")  # fmt: skip
    long_documents: str = option("split", DATA, "packed / chat data: a document longer than --seq-length is split "
                                 "into row-sized pieces, cut to its first row, or left out; how many were is "
                                 "reported at start-up (default: split)", choices=LONG_DOCUMENTS)  # fmt: skip
    valid_data: str | None = option(None, DATA, "validation data in any of --data's forms (and --pack): "
                                    "the LM and MTP loss (global token mean, no gradients, dropout off) every "
                                    "--eval-interval steps and at the end, in metrics.jsonl, TensorBoard and "
                                    "loss.png")  # fmt: skip
    valid_split: float = option(0.0, DATA, "instead of --valid-data: hold out this fraction of --data's samples "
                                "(its last ones; at most 0.5) for validation; training reads the rest")  # fmt: skip
    eval_interval: int = option(0, DATA, "steps between evaluations (0: at the end only)", least=0)
    eval_iters: int = option(10, DATA, "global batches (of the training batch size) per evaluation; the same "
                             "samples every time", least=1)  # fmt: skip
    eval_at_start: bool = option(False, DATA, "also evaluate before the first step")
    tokenizer: str = option("bytes", DATA, "'bytes' or a tokenizer directory (default: bytes for presets, "
                            "--hf-dir otherwise)")  # fmt: skip
    seq_length: int = option(64, DATA, plan=MEMORY, least=1)
    micro_batch_size: int = option(2, DATA, plan=MEMORY, least=1)
    global_batch_size: int | None = option(None, DATA, "sequences per optimizer step over all ranks (default: "
                                           "micro batch x world size)", least=1)  # fmt: skip
    seed: int = option(1234, DATA)
    # ---- optimization
    train_iters: int = option(60, OPTIMIZATION, least=0)
    train_epochs: float | None = option(None, OPTIMIZATION, "train this many passes over the training samples "
                                        "(held-out ones excluded): sets the steps, rounded up, once the data is "
                                        "read (refused together with --train-iters)")  # fmt: skip
    lr: float = option(3e-3, OPTIMIZATION, least=0)
    min_lr: float = option(3e-4, OPTIMIZATION, "the cosine decay's floor (default: --lr / 10)", least=0)
    warmup: int = option(5, OPTIMIZATION, "linear warmup steps, then cosine decay to --min-lr", least=0)
    weight_decay: float = option(0.01, OPTIMIZATION, least=0)
    no_decay_pattern: str | None = option(None, OPTIMIZATION, "regex of parameter names without weight decay, in "
                                          "addition to biases and 1-D parameters (norm weights, A_log, dt_bias, mHC "
                                          "base/scale)")  # fmt: skip
    clip_grad: float = option(1.0, OPTIMIZATION, least=0)
    router_bias_update_rate: float = option(DEFAULT_ROUTER_BIAS_UPDATE_RATE, OPTIMIZATION, "aux-loss-free "
                                            "balancing step; 0 turns it off (default: 1e-2 for the tiny preset, "
                                            "else 1e-3)", least=0)  # fmt: skip
    # ---- checkpoints and output
    save: str | None = option(None, OUTPUT, "checkpoint directory")
    save_interval: int = option(0, OUTPUT, "steps between saves (0: only at the end)", least=0)
    keep_last: int = option(0, OUTPUT, "keep this run's newest N checkpoints in --save: once a newer one is whole, "
                            "this run's older tags are removed (never the one 'latest' names, never one another run "
                            "wrote; 0: keep all)", least=0)  # fmt: skip
    load: str | None = option(None, OUTPUT, "resume from this checkpoint directory (its 'latest' tag)")
    load_tag: str | None = option(None, OUTPUT, "resume from this tag instead of 'latest' (e.g. step300)")
    load_model_only: bool = option(False, OUTPUT, "take only --load's weights (at any layout): fresh optimizer "
                                   "state, step 0, data from the start. Without it --load resumes everything, also "
                                   "at another world size, EP, ETP, SP, ZeRO stage or dtype")  # fmt: skip
    save_into_existing: bool = option(False, OUTPUT, "let a run that does not resume from --save (--load the same "
                                      "directory) write there although it holds checkpoints: its tags of the same "
                                      "names are replaced and 'latest' moves to this run's (refused without "
                                      "this)")  # fmt: skip
    export_hf: str | None = option(None, OUTPUT, "write a transformers-loadable directory at the end (with "
                                   "--hf-dir's tokenizer files); refused if it exists and is not empty, unless "
                                   "--force")  # fmt: skip
    export_format: str = option("dense", OUTPUT, "--export-hf's weights: dense = the model's dtype (a config.json "
                                "without quantization_config); fp8 = the tensors the FP8 --hf-dir stores in "
                                "block-FP8 requantised to its layout, the error vs the dense merge said at the end",
                                choices=EXPORT_FORMATS)  # fmt: skip
    export_adapter: str | None = option(None, OUTPUT, "a LoRA run: write its adapters as a PEFT adapter at the end "
                                        "(adapter_config.json + adapter_model.safetensors, transformers' glm5_next "
                                        "module names); refused if it exists and is not empty, unless --force")  # fmt: skip
    force: bool = option(False, OUTPUT, "let --export-hf / --export-adapter write into an existing non-empty "
                         "directory: the files it writes replace their namesakes, nothing is deleted")  # fmt: skip
    output_dir: str = option(os.path.join("runs", "tiny"), OUTPUT, "metrics.jsonl and loss.png (default: "
                             "runs/<model>)")  # fmt: skip
    check_replicas_interval: int = option(0, OUTPUT, "also before every save", least=0)
    log_interval: int = option(10, OUTPUT, least=0)
    sample_prompts: str | None = option(None, OUTPUT, "generate from these prompts while training (.jsonl: "
                                        "{\"prompt\": ...} or {\"messages\": [...]}; otherwise one per line): "
                                        "greedy, through the chat template for chat data; written to <output "
                                        "dir>/samples.jsonl and TensorBoard / W&B text, the training unchanged")  # fmt: skip
    sample_interval: int = option(0, OUTPUT, "steps between samples (0: at the end only)", least=0)
    sample_tokens: int = option(48, OUTPUT, "new tokens per sample, at most", least=1)
    peak_tflops: float | None = option(None, OUTPUT, "the GPU's dense bf16 peak in TFLOP/s, for the MFU the log "
                                       "shows (default: 989 on H100 / H200, 312 on A100, ...: by the GPU's name; "
                                       "none on CPU)")  # fmt: skip
    tensorboard_dir: str | None = option(None, OUTPUT)
    wandb_project: str | None = option(None, OUTPUT, "also log the metrics to Weights & Biases (rank 0; pip "
                                       "install \"glm53_ds[wandb]\")")  # fmt: skip
    wandb_mode: str = option("online", OUTPUT, "offline: no network, the run is kept under --output-dir for "
                             "`wandb sync` (default: online)", choices=("online", "offline"))  # fmt: skip
    wandb_name: str | None = option(None, OUTPUT, "the W&B run's name (default: W&B's)")
    # ---- planning (python -m glm53_ds.plan --config reads them; the trainer compares gpus with its world)
    gpus: int | None = option(None, PLANNING, "the GPUs the run is planned for (`python -m glm53_ds.plan "
                              "--config` checks the description at this world; a run launched on another number "
                              "says so)", plan=SEARCHED, least=1)  # fmt: skip
    gpu_memory: str = option("141GB", PLANNING, "the memory of one GPU the plan is checked against (default: "
                             "141GB, an H200)", plan=MEMORY)  # fmt: skip
    # ---- DeepSpeed
    deepspeed_config: str | None = option(None, DEEPSPEED, "a DeepSpeed JSON config (ZeRO stage, bf16, ...); "
                                          "batch sizes and clipping must agree with the command line (default: "
                                          "ds_configs' choice by device)", flag="--deepspeed_config", plan=MEMORY)  # fmt: skip
    offload_optimizer: str = option("none", DEEPSPEED, "cpu: DeepSpeed's ZeRO-Offload, the fp32 masters, gradients "
                                    "and Adam moments of the rank's partition in (pinned) host memory and the update "
                                    "by DeepSpeedCPUAdam on the host; the GPU keeps the bf16 weights and gradients "
                                    "(ZeRO 1 or 2; docs/usage.md)", choices=("none", "cpu"), plan=MEMORY)  # fmt: skip
    dist_timeout: float = option(1800.0, DEEPSPEED, "seconds a collective waits for a rank before the run ends, "
                                 "naming the ranks and nodes that vanished and the last whole checkpoint (a killed "
                                 "node is seen at once; a frozen one, a hung GPU or a cut network only after this; "
                                 "longer than any save or first-step kernel tuning) (default: 1800)", least=1)  # fmt: skip

    def lr_at(self, step: int) -> float:
        """Linear warmup to --lr over --warmup steps, then cosine decay to --min-lr at --train-iters."""
        if self.warmup > 0 and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(self.train_iters - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def lora_spec(self) -> LoraSpec | None:
        """The LoRA adapters the run trains (None: no LoRA); a ValueError names a bad value."""
        if self.lora_rank == 0:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        alpha = float(self.lora_rank) if self.lora_alpha is None else self.lora_alpha
        return LoraSpec(
            rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout, targets=targets, seed=self.seed
        )

    def transformer_overrides(self) -> dict[str, Any]:
        """The TransformerConfig fields the run's options set (layout, losses, loss chunks, offload, tiles,
        recompute): the trainer's model and the planner's meta model are built from the same ones."""
        return dict(
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
            moe_seq_aux_loss_coef=self.aux_loss_coef, indexer_loss_coef=self.indexer_loss_coef,
            loss_chunk_bytes=self.loss_chunk_mib * 2**20, offload_activations=self.offload_activations,
            moe_tile_bytes=self.moe_tile_mib * 2**20, **recompute_overrides(self.recompute),
        )  # fmt: skip
