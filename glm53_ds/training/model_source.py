"""Which model a run trains: `resolve_model` (--hf-dir, --model-config, --load's record, or the tiny preset) and
the checks of a config.json given to it, shared by the trainer and the planner."""

from __future__ import annotations

import json
import os

from ..checkpoint import CheckpointDir
from ..config import Glm53Config
from .errors import SetupError
from .presets import PRESETS, named_config, preset


def resolve_model(
    hf_dir: str | None, model_config: str | None, load: str | None, load_tag: str | None
) -> tuple[Glm53Config, str]:
    """(the model config the run builds, its name). The config: --hf-dir's config.json, else --model-config (a
    file or a preset), else the one --load's checkpoint records (a converted or training checkpoint trains as
    itself), else the tiny preset. The name (runs/<name>, the preset defaults) comes from the model, not from the
    route: the preset it equals, whichever way it came; else its source's base name."""
    if hf_dir:
        cfg, name = Glm53Config.from_hf(hf_dir), os.path.basename(os.path.normpath(hf_dir))
        if model_config:  # e.g. a recipe's model beside the weights given on the command line: the same model
            named = named_config(model_config)
            theirs, mine = named.to_text_dict(), cfg.to_text_dict()
            differ = sorted(
                k for k in theirs.keys() | mine.keys() if k not in RUN_FIELDS and theirs.get(k) != mine.get(k)
            )
            if differ:
                raise SetupError(
                    f"--hf-dir {hf_dir} is not --model-config {model_config}: they differ in "
                    f"{', '.join(f'{k} ({mine.get(k)!r} vs {theirs.get(k)!r})' for k in differ[:3])}"
                    f"{' and more' if len(differ) > 3 else ''}; give one of them"
                )
    elif model_config:
        cfg = named_config(model_config)
        name = (
            model_config if model_config in PRESETS else os.path.splitext(os.path.basename(model_config))[0]
        )
    elif load:
        try:
            stored = CheckpointDir(load, load_tag or None).meta.get("config")
        except (OSError, ValueError) as e:
            raise SetupError(f"--load {load!r}: {e}") from e
        if not stored:
            raise SetupError(
                f"--load {load!r}: the checkpoint does not record its model config; give --model-config"
            )
        cfg, name = Glm53Config.from_text_dict(stored), os.path.basename(os.path.normpath(load))
    else:
        cfg, name = preset("tiny"), "tiny"
    mine = {k: v for k, v in cfg.to_text_dict().items() if k not in RUN_FIELDS}
    same = [n for n, make in PRESETS.items() if {k: v for k, v in make().to_text_dict().items() if k not in RUN_FIELDS} == mine]  # fmt: skip
    return cfg, same[0] if same else name


# A model this wide is not a toy: the tiny CPU job's defaults of these options (64-token rows, lr 3e-3, 60 steps,
# the shipped 40 KB corpus) would make a run that means nothing, so they must be given (flags or --config).
REAL_WIDTH = 1024
RUN_SCALE_OPTIONS = ("data", "seq_length", "micro_batch_size", "lr", "train_iters")


# Config fields a run may set itself (they do not make another model).
RUN_FIELDS = frozenset({"mtp_loss_weight"})

# Keys a config.json must give (transformers would fall back to the released sizes without a word).
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_model_config_file(option: str, path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise SetupError(f"{option}: {path}:{e.lineno}: not valid JSON ({e.msg})") from e
    except UnicodeDecodeError as e:
        raise SetupError(
            f"{option}: {path}: not UTF-8 text (byte {e.start}); a config.json is UTF-8 JSON"
        ) from e
    except OSError as e:
        raise SetupError(f"{option}: {path}: cannot read it ({e.strerror})") from e
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(text, dict):
        raise SetupError(f"{option}: {path}: expected a JSON object")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in text]
    if missing:
        raise SetupError(
            f"{option}: {path} does not give {', '.join(missing)} (refusing to assume the released sizes)"
        )
