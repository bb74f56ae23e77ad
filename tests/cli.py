"""The command line as the tests run it: the trainer under `deepspeed` or plain Python, its one-line errors, its
metrics, and released-layout checkpoints written in-process for it to start from."""

from __future__ import annotations

import json
import os
import subprocess

import torch

from glm53_ds.compat.deepspeed_shm import remove_buffers
from glm53_ds.parallel.state import free_port
from glm53_ds.training.args import build_parser
from glm53_ds.training.config import TrainConfig
from glm53_ds.training.option_checks import resolve_config
from tests.forked_processes import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
DIE_DURING_SAVE = os.path.join(ROOT, "tests", "die_during_save.py")  # the trainer, killed inside one save
# Subprocess limits catch a hang, not a slow machine: a loaded 2-core machine ran a 4-minute test in 5.5 minutes.
# A hang costs the whole limit, and CI has 90 minutes: 15 minutes, not 30.
HANG_TIMEOUT = 900


def deepspeed_run(
    ranks: int, *args: str, env: dict | None = None, timeout: int = HANG_TIMEOUT, script: str = TRAIN,
    launcher: bool = False,
) -> subprocess.CompletedProcess:  # fmt: skip
    """`deepspeed --num_gpus ranks script args`: the ranks forked from the tests' fork server as the launcher would
    start them (tests/forked_processes.py), or through the real launcher (`launcher=True`)."""
    from tests.conftest import refuse_in_the_fast_lane

    refuse_in_the_fast_lane(f"starts {ranks} ranks through DeepSpeed's launcher")
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    try:
        if not launcher:
            return run_script(script, list(args), ranks=ranks, env=env, timeout=timeout, port=port)
        cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), script, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **env})  # fmt: skip
    finally:
        remove_buffers(port)  # DeepSpeed's /dev/shm buffers of ranks killed on purpose


def python_run(*args: str, timeout: int = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """`python launch/train.py args`, forked from the tests' fork server."""
    return run_script(TRAIN, list(args), timeout=timeout)


def module_run(module: str, *args: str, timeout: int = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """`python -m module args` (the planner's and the converter's commands), forked from the tests' fork server:
    a process of its own without the ~7 s of imports a fresh interpreter spends first."""
    return run_script(module, list(args), timeout=timeout, module=True)


def metrics(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def tiny_hf_checkpoint(path) -> None:
    """A released-layout checkpoint of the tiny preset (with MTP), written in-process."""
    from glm53_ds.training.presets import tiny

    write_hf_checkpoint(path, tiny())


def write_hf_checkpoint(path, cfg, mtp: bool = True, seed: int = 0) -> None:
    """A released-layout checkpoint of `cfg` written in-process (MTP tensors only with `mtp`), no tokenizer."""
    import glm53_ds
    from glm53_ds.checkpoint import ShardWriter
    from glm53_ds.convert.export_hf import SMALL_VISION
    from glm53_ds.convert.names import released_tensors

    torch.manual_seed(seed)
    model = glm53_ds.build_model(cfg)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    writer = ShardWriter(str(path), "model", index_file="model.safetensors.index.json")
    for name, tensor in released_tensors(state, cfg, mtp=mtp):
        writer.add(name, tensor)
    writer.close()
    config = dict(model_type="glm5_next", text_config=cfg.to_text_dict(), vision_config=SMALL_VISION)
    (path / "config.json").write_text(json.dumps(config))


QUICK = ["--train-iters", "2", "--seq-length", "16"]


def run(*args: str, script: str = TRAIN, timeout: int = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """`python script args` with one intra-op thread, forked from the tests' fork server."""
    return run_script(script, list(args), env={"OMP_NUM_THREADS": "1"}, timeout=timeout)


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def train_config(*argv: str) -> TrainConfig:
    """The trainer's configuration for a command line, resolved as the trainer does (no process started)."""
    from glm53_ds.training.run_file import parse_with_config

    return resolve_config(parse_with_config(build_parser(), list(argv))[0])
