"""The recipes (recipes/*.toml) and the released-model commands in the docs fit by the planner, and each recipe is a
complete run for the trainer. Before: the docs' flagship command needed 328.9 GiB per rank (64 H200, EP 32 x ETP 2,
selective recompute), and the LoRA command ran the tiny CPU job's 64-token rows at lr 3e-3."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex

import pytest

from glm53_ds.training.presets import preset
from tests.cli import ROOT, module_run, train_config

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml")))
# the planner's flags a command may give beside --config (the trainer spells them the same)
PLANNER_FLAGS = ("--ep", "--etp", "--sp", "--seq-length", "--micro-batch-size", "--recompute", "--lora-rank")


def docs_commands() -> list[str]:
    """Every `launch/train.py` command in README and docs/ that trains the released model (its weights by path)."""
    found = []
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        text = open(path, encoding="utf-8").read().replace("\\\n", " ")
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            found += [
                line for line in block.splitlines() if "launch/train.py" in line and "GLM-5.3-Flash" in line
            ]
        found += [
            cmd for cmd in re.findall(r"`(deepspeed [^`]*launch/train\.py[^`]*)`", text) if "/ckpt/" in cmd
        ]
    return found


def _plan(*args: str) -> dict:
    proc = module_run("glm53_ds.plan", *args, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_there_are_recipes_and_docs_commands_to_check():
    names = {os.path.basename(r) for r in RECIPES}
    assert {"lora_r16_8xh200_8k.toml", "lora_r16_32xh100_8k.toml", "full_sft_128xh200_8k.toml",
            "full_sft_128xh200_32k.toml"} <= names  # fmt: skip
    assert len(docs_commands()) >= 3


def test_every_released_model_command_in_the_docs_starts_from_a_recipe():
    """A command spelling out a released-model run flag by flag is how the unfit one got in: they use a recipe."""
    bare = [cmd for cmd in docs_commands() if not re.search(r"--config recipes/\S+\.toml", cmd)]
    assert bare == []


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_a_recipe_is_a_complete_run_for_the_trainer(tmp_path, recipe):
    """Resolved as the trainer does, with the weights (the released config) and data given: no option missing."""
    released = tmp_path / "GLM-5.3-Flash"
    released.mkdir()
    (released / "config.json").write_text(json.dumps(preset("glm-5.3-flash").to_text_dict()))
    config = train_config("--config", recipe, "--hf-dir", str(released), "--tokenizer", "bytes", "--data",
                          os.path.join(ROOT, "data", "tiny_corpus.txt"), "--output-dir", str(tmp_path / "out"),
                          "--save", str(tmp_path / "ck"))  # fmt: skip
    assert config.seq_length >= 8192 and config.lr <= 2e-4 and config.min_lr < config.lr and config.gpus
    assert config.recompute == "full" and config.deepspeed_config == "ds_configs/zero2_bf16.json"
    # control: the same without the recipe is refused (the real-width rule the recipe satisfies)
    with pytest.raises(ValueError, match="is a model of real width"):
        train_config("--hf-dir", str(released), "--tokenizer", "bytes", "--output-dir", str(tmp_path / "o2"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_the_planner_says_each_recipe_fits(recipe):
    result = _plan("--config", recipe)
    text = open(recipe, encoding="utf-8").read()
    gpus = int(re.search(r"^gpus = (\d+)", text, flags=re.M).group(1))
    assert result["world"] == gpus and result["model"] == "glm-5.3-flash"
    assert result["memory"]["fits"], (recipe, result["memory"]["total"] / 2**30)


@pytest.mark.slow
def test_the_planner_says_each_docs_command_fits():
    for command in docs_commands():
        words = shlex.split(command)
        recipe = words[words.index("--config") + 1]
        flags = [
            w for i, w in enumerate(words) if w in PLANNER_FLAGS or (i and words[i - 1] in PLANNER_FLAGS)
        ]
        result = _plan("--config", os.path.join(ROOT, recipe), *flags)
        assert result["memory"]["fits"], (command, result["memory"]["total"] / 2**30)


def test_the_planner_reads_a_run_file(tmp_path):
    """`plan --config`: the run as the trainer would make it (its defaults where the file says nothing), flags
    beside it override; a bad file is one error line."""
    from glm53_ds.plan.__main__ import run_file_arguments

    run = tmp_path / "run.toml"
    run.write_text('[model]\nmodel_config = "tiny"\nloss_chunk_mib = 0\nindexer_loss_coef = 0.1\n'
                   '[parallelism]\nep = 2\n[data]\nseq_length = 128\n'
                   '[deepspeed]\ndeepspeed_config = "ds_configs/zero1_bf16.json"\n[planning]\ngpus = 4\n')  # fmt: skip
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        argv = run_file_arguments(str(run))
    finally:
        os.chdir(cwd)
    assert argv == [
        "--model-config",
        "tiny",
        "--ep",
        "2",
        "--seq-length",
        "128",
        "--indexer-loss-coef",
        "0.1",
        "--loss-chunk-mib",
        "0",
        "--zero",
        "1",
        "--world",
        "4",
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallelism]\nexperts = 2\n")
    proc = module_run("glm53_ds.plan", "--config", str(bad), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --config {bad}: [parallelism] has no key 'experts'"
    )
