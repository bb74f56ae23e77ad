"""`training/metrics.py`: the same scalars to TensorBoard and Weights & Biases (here a recording stand-in for the
optional wandb package: what the writer calls, in which mode, with which names and steps), validation records
under `valid/`, and the W&B options refused before any work without the package or the project."""

from __future__ import annotations

import sys
import types

import pytest

from glm53_ds.training.config import SetupError
from glm53_ds.training.metrics import MetricsWriter, WandbRun, read_metrics, scalar_tag
from tests.cli import train_config


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init(self, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(("init", kwargs))
        return self

    def log(self, scalars, step):  # type: ignore[no-untyped-def]
        self.calls.append(("log", (dict(scalars), step)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def test_wandb_gets_the_tensorboard_scalars_offline(tmp_path, monkeypatch):
    recorder = _Recorder()
    module = types.ModuleType("wandb")
    module.init = recorder.init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    writer = MetricsWriter(str(tmp_path), None, wandb_run=WandbRun("glm53", "offline", "run1", {"lr": 1e-3}))
    writer.write({"step": 1, "loss": 2.5, "lm_loss": 2.0, "grad_norm": None})
    writer.write({"step": 2, "valid_lm_loss": 1.9, "valid_target_tokens": 64})
    writer.close()
    assert recorder.calls == [
        ("init", dict(project="glm53", name="run1", mode="offline", dir=str(tmp_path), config={"lr": 1e-3})),
        ("log", ({"train/loss": 2.5, "train/lm_loss": 2.0}, 1)),
        ("log", ({"valid/lm_loss": 1.9, "valid/target_tokens": 64}, 2)),
        ("finish", None),
    ]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    assert scalar_tag("valid_mtp_loss") == "valid/mtp_loss" and scalar_tag("lr") == "train/lr"


def test_wandb_options_are_refused_without_the_package_or_the_project(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(SetupError, match=r"--wandb-project 'glm53': the wandb package is not installed"):
        train_config("--wandb-project", "glm53")
    with pytest.raises(SetupError, match=r"--wandb-mode / --wandb-name without --wandb-project"):
        train_config("--wandb-mode", "offline")
