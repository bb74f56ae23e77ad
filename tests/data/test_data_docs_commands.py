"""The data commands of README.md ("Data") and docs/usage.md ("Data") run as written, tiny sizes substituted: every
form they name is made here with `datasets` (a parquet file, a glob of parquet shards, a folder of jsonl shards,
JSON Lines under .json, a DatasetDict folder, a hub dataset in a fake local cache, a source with another column
name), `prepare` builds each cache, and the training command reads the prepared caches without building."""

from __future__ import annotations

import os
import re
import shlex

import pytest

datasets = pytest.importorskip("datasets")

from tests.cli import ROOT, deepspeed_run, metrics, write_hf_checkpoint  # noqa: E402
from tests.data.test_hf_sources import _fake_hub_cache, _rows  # noqa: E402
from tests.forked_processes import run_script  # noqa: E402


def _blocks(doc: str, heading: str) -> list[str]:
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].strip().splitlines()  # its first block


def _make_forms(root) -> None:
    ds = datasets.Dataset.from_list(_rows(30))
    data = root / "data"
    (data / "shards").mkdir(parents=True)
    (data / "jsonl_shards").mkdir()
    ds.to_parquet(str(data / "chat.parquet"))
    ds.to_json(str(data / "chat.json"))
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(data / "shards" / f"train-0000{k}-of-00002.parquet"))
        ds.shard(2, k, contiguous=True).to_json(str(data / "jsonl_shards" / f"train-0000{k}-of-00002.jsonl"))
    datasets.DatasetDict(train=ds, test=ds.select(range(6))).save_to_disk(str(data / "saved"))
    ds.rename_column("messages", "dialog").to_parquet(str(data / "dialogs.parquet"))
    ultrachat = ds.map(
        lambda r, i: {"prompt": r["messages"][0]["content"], "prompt_id": str(i)}, with_indices=True
    )
    ultrachat.to_parquet(str(root / "ultrachat.parquet"))
    _fake_hub_cache(root / "hub", "HuggingFaceH4/ultrachat_200k", str(root / "ultrachat.parquet"))
    hub_data = next((root / "hub").glob("datasets--*/snapshots/*/data"))
    os.rename(hub_data / "train-00000-of-00001.parquet", hub_data / "train_sft-00000-of-00001.parquet")


@pytest.mark.slow
def test_the_data_commands_of_the_docs_run_as_written(tmp_path):
    datasets.disable_progress_bars()
    _make_forms(tmp_path)
    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer
    from glm53_ds.training.presets import tiny

    (tmp_path / "hf").mkdir()
    write_hf_checkpoint(tmp_path / "hf", tiny())
    write_byte_tokenizer(str(tmp_path / "hf"))
    tiny = tmp_path / "tiny_recipe.toml"  # the recipe's data-shaping options at tiny sizes
    tiny.write_text(
        "[fine_tuning]\nlora_rank = 4\n[data]\npack = true\nseq_length = 64\nmicro_batch_size = 1\n"
        "global_batch_size = 2\nvalid_split = 0.1\neval_iters = 1\n[optimization]\ntrain_iters = 2\n"
    )
    swaps = {"--config recipes/lora_r16_8xh200_8k.toml": f"--config {tiny}", "/data/": f"{tmp_path}/data/",
             "/ckpt/GLM-5.3-Flash": str(tmp_path / "hf"), "/shared/data_cache": str(tmp_path / "cache")}  # fmt: skip
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "OMP_NUM_THREADS": "1"}
    lines = _blocks("README.md", "\n## Data\n") + _blocks("docs/usage.md", "\n## Data\n")
    trains = [line for line in lines if line.startswith("deepspeed --num_gpus 8 launch/train.py")]
    prepares = [line for line in lines if line.startswith("python -m glm53_ds.data prepare")]
    assert len(prepares) >= 8 and len(trains) == 2 and len(lines) == len(prepares) + len(trains), lines
    for k, line in enumerate(prepares + trains):
        for old, new in swaps.items():
            line = line.replace(old, new)
        argv = shlex.split(line)
        if argv[0] == "python":
            proc = run_script("glm53_ds.data", argv[3:], env=env, module=True)
            assert proc.returncode == 0, (line, proc.stderr[-3000:])
            assert "prepared --data" in proc.stdout, line
            continue
        out = tmp_path / f"run{k}"
        proc = deepspeed_run(1, *argv[argv.index("launch/train.py") + 1 :], "--output-dir", str(out), env=env)
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
        assert "tokenising" not in proc.stderr, line  # the prepared caches, read
        assert "data: a mixture of 2 sources" in proc.stderr
        assert [r["step"] for r in metrics(out) if "lm_loss" in r] == [1, 2]
