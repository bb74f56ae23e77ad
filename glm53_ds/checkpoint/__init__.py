"""The checkpoint format's one owner: the directory, its tensor sets, publishing and verifying, placements.

A checkpoint directory holds tags and `latest` (the tag to resume). A tag (a training save, or `hf-to-native`'s
converted `native/`) is

    <tag>/manifest.json                     every file below with its size and CRC-32, written last
    <tag>/<DeepSpeed's files>               ZeRO optimizer partitions, one file per rank; client state (training)
    <tag>/glm53/layout.json                 format, world size, EP, ETP, SP, ZeRO stage, dtype, the Glm53Config,
                                            model_only, the layout-free optimizer state's step,
                                            adapters_only (a LoRA run's: no frozen base; `base_weights`)
    <tag>/glm53/hf_config.json              converted: the config.json the weights came from, verbatim
    <tag>/glm53/replicated.*                every non-expert tensor (a tensor set: index + safetensors files)
    <tag>/glm53/experts_ep<EEE>_etp<TTT>.*  one EP x ETP expert shard: [E/EP, 2I/ETP, D] and [E/EP, D, I/ETP]
    <tag>/glm53/optimizer_<set>.*           the layout-free optimizer state (fp32 master where the model holds
                                            another dtype, Adam moments) of each model set's tensors, keyed
                                            `<name>:master|exp_avg|exp_avg_sq`; written by many ranks
                                            (`<set>-rank<R>-NNNNN`), one index per set
    <tag>/glm53/optimizer_rank<RRRRR>.pt    stage 0 only: each rank's optimizer state
    <tag>/glm53/client_state.pt             the trainer's step, data position and RNG (layout-free)
    <tag>/glm53/fp32_params_optimizer.pt    bf16 runs: the optimizer state of HF's fp32-kept parameters

Modules: `tensor_sets` (a set's streaming writer and reader) over `safetensors_file` (positioned reads);
`placement` (where a rank's tensor sits in the global tensor: every read is an overlap of placements);
`base_weights` (the base an adapter checkpoint records and is checked against); `directory` (`CheckpointDir`: resolving `latest`, the layout record and its refusals, reads at any layout,
completeness); `publish` (staging, manifest, rename, `latest`; verify before any read). What the engine adds (its
optimizer state through DeepSpeed, DeepSpeed's own files) is `engine/checkpoint.py`; what the converters add (the
released naming) is `convert/`. Nothing here imports DeepSpeed or the model.
"""

from .directory import (
    CLIENT_STATE,
    FP32_PARAMS_OPTIMIZER,
    MODEL_DIR,
    OPTIMIZER,
    CheckpointDir,
    CheckpointError,
    latest_tag,
    layout_record,
    moved,
    optimizer_rank_file,
    read_layout,
    resolve,
    write_layout,
)
from .placement import REPLICATED, TensorPlacement, expert_set_name, global_shape, placement
from .publish import StagedTag, verify_checkpoint
from .tensor_sets import DEFAULT_SHARD_BYTES, ShardReader, ShardWriter, write_index

__all__ = [
    "CLIENT_STATE",
    "DEFAULT_SHARD_BYTES",
    "FP32_PARAMS_OPTIMIZER",
    "MODEL_DIR",
    "OPTIMIZER",
    "REPLICATED",
    "CheckpointDir",
    "CheckpointError",
    "ShardReader",
    "ShardWriter",
    "StagedTag",
    "TensorPlacement",
    "expert_set_name",
    "global_shape",
    "latest_tag",
    "layout_record",
    "moved",
    "optimizer_rank_file",
    "placement",
    "read_layout",
    "resolve",
    "verify_checkpoint",
    "write_index",
    "write_layout",
]
