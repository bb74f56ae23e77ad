"""The recipes (recipes/*.toml) and the released-model commands in the docs fit by the planner, and each recipe is a
complete run for the trainer. Before: the docs' flagship command needed 328.9 GiB per rank (64 H200, EP 32 x ETP 2,
selective recompute), and the LoRA command ran the tiny CPU job's 64-token rows at lr 3e-3."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import tomllib

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
    # ZeRO 2, or ZeRO 1 with the optimizer state on the host (ZeRO-Offload: the GPU keeps whole bf16 gradients)
    zero = "zero1_bf16" if config.offload_optimizer == "cpu" else "zero2_bf16"
    assert config.recompute == "full" and config.deepspeed_config == f"ds_configs/{zero}.json"
    # control: the same without the recipe is refused (the real-width rule the recipe satisfies)
    with pytest.raises(ValueError, match="is a model of real width"):
        train_config("--hf-dir", str(released), "--tokenizer", "bytes", "--output-dir", str(tmp_path / "o2"))


# a recipe as shipped on this machine: the tiny model, one rank's layout, CPU DeepSpeed, short rows (everything else,
# outputs, exports, validation, schedule and batch, as the file gives it)
TINY = ("--model-config", "tiny", "--data", os.path.join(ROOT, "data", "tiny_chat.jsonl"), "--ep", "1", "--etp", "1",
        "--sp", "1", "--seq-length", "256", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "cpu.json"))  # fmt: skip


@pytest.fixture(scope="module")
def tiny_fp8_release(tmp_path_factory) -> str:
    """The tiny model as the FP8 download stores it (block-FP8 experts, 16 x 16 blocks): what `--base-quant fp8`
    recipes take as --hf-dir."""
    from tests.model_fixtures import save_fp8_copy, save_tiny_hf

    bf16 = tmp_path_factory.mktemp("tiny_bf16")
    save_tiny_hf(bf16, preset("tiny").to_text_dict())
    return str(save_fp8_copy(bf16, tmp_path_factory.mktemp("fp8") / "tiny_fp8", (16, 16)))


# TINY's DeepSpeed config under ZeRO 1, for the recipes that offload the optimizer (ZeRO-Offload needs ZeRO 1 / 2)
CPU_ZERO1 = os.path.join(ROOT, "tests", "ds_cpu_zero1.json")


def _tiny_for(recipe: str, fp8_release: str) -> tuple[str, ...]:
    """TINY, and for a recipe that keeps its base in block-FP8 the tiny FP8 download as its weights; for one that
    offloads the optimizer state CPU DeepSpeed under ZeRO 1."""
    with open(recipe, "rb") as f:
        tables = tomllib.load(f)
    fp8 = tables.get("fine_tuning", {}).get("base_quant") == "fp8"
    tiny = (*TINY, "--hf-dir", fp8_release, "--tokenizer", "bytes") if fp8 else TINY
    return (
        (*tiny, "--deepspeed_config", CPU_ZERO1)
        if tables.get("deepspeed", {}).get("offload_optimizer") == "cpu"
        else tiny
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_each_recipe_passes_the_trainers_own_set_up(tmp_path, monkeypatch, recipe, tiny_fp8_release):
    """Before: every recipe was refused at set-up (`--export-adapter 'runs/.../adapter' is inside --output-dir`),
    after DeepSpeed had started on every GPU, while this file only resolved the options. Now each starts the
    trainer's whole set-up (data, layout, model, engine, locks, the run file) with the tiny model substituted; its
    exports sit inside its output directory, as users expect (runs/x/hf)."""
    from glm53_ds.engine import close_distributed
    from glm53_ds.training.trainer import Trainer

    monkeypatch.chdir(tmp_path)  # the recipe's relative outputs (runs/...) land here
    config = train_config("--config", recipe, *_tiny_for(recipe, tiny_fp8_release))
    exports = [p for p in (config.export_hf, config.export_adapter) if p]
    assert exports and all(os.path.dirname(p) == config.output_dir for p in exports), (
        exports,
        config.output_dir,
    )
    trainer = Trainer(config)
    try:
        trainer.setup()
        kept = trainer.base_quant.kept
    finally:
        trainer.close()
        close_distributed()
    assert os.path.isfile(os.path.join(config.output_dir, "run.toml"))
    assert kept == ("block_fp8" if config.base_quant == "fp8" else "dense")


def test_an_export_may_sit_inside_the_output_dir_but_not_be_it_or_hold_it(tmp_path):
    """The rule the recipes rely on, and its limits (the control: an export that is the output directory, or
    holds it, would be replaced under the run's own metrics)."""
    out = str(tmp_path / "run")
    assert train_config("--output-dir", out, "--export-hf", os.path.join(out, "hf")).export_hf
    with pytest.raises(ValueError, match=r"--export-hf .* is --output-dir"):
        train_config("--output-dir", out, "--export-hf", out)
    with pytest.raises(ValueError, match=r"--export-hf .* contains --output-dir"):
        train_config("--output-dir", os.path.join(out, "hf", "logs"), "--export-hf", os.path.join(out, "hf"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["lora_r16_8xh200_8k.toml", "full_sft_128xh200_8k.toml"])
def test_a_recipe_runs_as_shipped_and_its_weights_are_readable(tmp_path, monkeypatch, recipe):
    """A LoRA and a full-SFT recipe run to their end (one step, its validation, the save, the export), tiny model
    substituted; every file of the checkpoint and the export is readable by others under umask 022 (before:
    safetensors' 0600)."""
    import stat

    from glm53_ds.engine import close_distributed
    from glm53_ds.training.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    old_mask = os.umask(0o022)
    try:
        config = train_config("--config", os.path.join(ROOT, "recipes", recipe), *TINY, "--train-iters", "1",
                              "--global-batch-size", "4")  # fmt: skip
        trainer = Trainer(config)
        try:
            trainer.run()
        finally:
            trainer.close()
            close_distributed()
    finally:
        os.umask(old_mask)
    written = [os.path.join(d, f) for root in (config.save, config.export_hf or config.export_adapter)
               for d, _, fs in os.walk(str(root)) for f in fs]  # fmt: skip
    assert any(p.endswith(".safetensors") for p in written)
    unreadable = [p for p in written if stat.S_IMODE(os.stat(p).st_mode) & 0o044 != 0o044]
    assert unreadable == []


@pytest.mark.slow
def test_the_planner_says_each_docs_command_fits():
    """Each command planned in its own process, two at a time (the tests run one at a time: a core would idle)."""
    from concurrent.futures import ThreadPoolExecutor

    def planned(command: str) -> tuple[str, dict]:
        words = shlex.split(command)
        recipe = words[words.index("--config") + 1]
        flags = [
            w for i, w in enumerate(words) if w in PLANNER_FLAGS or (i and words[i - 1] in PLANNER_FLAGS)
        ]
        return command, _plan("--config", os.path.join(ROOT, recipe), *flags)

    with ThreadPoolExecutor(2) as pool:
        for command, result in pool.map(planned, docs_commands()):
            assert result["memory"]["fits"], (command, result["memory"]["total"] / 2**30)


def test_the_planner_reads_a_run_file(tmp_path):
    """`plan --config`: the run as the trainer would make it (its defaults where the file says nothing), flags
    beside it override; a bad file is one error line. (Each recipe's numbers: tests/plan/test_planner_numbers.py.)"""
    from glm53_ds.plan.__main__ import planned_run

    run = tmp_path / "run.toml"
    run.write_text('[model]\nmodel_config = "tiny"\nloss_chunk_mib = 0\nindexer_loss_coef = 0.1\n'
                   '[parallelism]\nep = 2\n[data]\nseq_length = 128\n'
                   '[deepspeed]\ndeepspeed_config = "ds_configs/zero1_bf16.json"\n[planning]\ngpus = 4\n')  # fmt: skip
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        planned, _ = planned_run(["--config", str(run)])
        flagged, _ = planned_run(["--config", str(run), "--ep", "4", "--world", "8", "--fp32"])
    finally:
        os.chdir(cwd)
    c = planned.config
    assert (c.model_config, c.ep, c.etp, c.seq_length, c.micro_batch_size, c.loss_chunk_mib, c.gpus) == (
        "tiny", 2, 1, 128, 2, 0, 4)  # fmt: skip
    assert (c.indexer_loss_coef, planned.zero, planned.bf16, planned.world) == (0.1, 1, True, 4)
    assert (flagged.config.ep, flagged.world, flagged.bf16, flagged.config.seq_length) == (4, 8, False, 128)
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallelism]\nexperts = 2\n")
    proc = module_run("glm53_ds.plan", "--config", str(bad), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --config {bad}: [parallelism] has no key 'experts'"
    )
