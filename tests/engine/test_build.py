"""The one DeepSpeed engine builder: version check, the list of patched private symbols (kept equal to the table in
docs/parallelism.md, and touched nowhere else), and `glm53_ds.build_engine` on a world of one."""

from __future__ import annotations

import os
import re

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.engine import Glm53Engine, deepspeed_internals
from tests.cli import ROOT
from tests.model_fixtures import CONFIG_A

INTERNALS = os.path.join(ROOT, "glm53_ds", "engine", "deepspeed_internals.py")


def _doc_table() -> list[tuple[str, str]]:
    """(symbol, how) rows of the patched-symbols table in docs/parallelism.md."""
    text = open(os.path.join(ROOT, "docs", "parallelism.md"), encoding="utf-8").read()
    section = text.split("## DeepSpeed internals", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \| (\w+) \|", section, flags=re.M)


def test_patched_symbols_table_matches_the_docs():
    listed = [(s.symbol, s.how) for s in deepspeed_internals.PATCHED_SYMBOLS]
    assert _doc_table() == listed


def test_no_other_module_touches_the_patched_symbols():
    names = {s.symbol.rsplit(".", 1)[-1] for s in deepspeed_internals.PATCHED_SYMBOLS}
    names -= {
        "MoE",
        "step",
        "optimizer",
        "mpu",
    }  # common words: the import of the one and assignments to the others are checked below
    offenders = []
    for directory, _, files in os.walk(os.path.join(ROOT, "glm53_ds")):
        for name in files:
            path = os.path.join(directory, name)
            if not name.endswith(".py") or path == INTERNALS:
                continue
            text = open(path, encoding="utf-8").read()
            offenders += [
                f"{os.path.relpath(path, ROOT)}: {n}"
                for n in sorted(names)
                if re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}\b", text)
            ]
            if "deepspeed.moe.layer" in text:
                offenders.append(f"{os.path.relpath(path, ROOT)}: deepspeed.moe.layer")
            if re.search(r"\.step\s*=[^=]", text):
                offenders.append(f"{os.path.relpath(path, ROOT)}: assigns a step method")
            if re.search(r"groups\.mpu\b", text):
                offenders.append(f"{os.path.relpath(path, ROOT)}: DeepSpeed's registered mpu")
    assert offenders == []
    # and every listed symbol is really used there
    source = open(INTERNALS, encoding="utf-8").read().split("PATCHED_SYMBOLS = (", 1)[1].split("\n)", 1)[1]
    assert all(s.symbol.rsplit(".", 1)[-1] in source for s in deepspeed_internals.PATCHED_SYMBOLS)


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.0.0"])
def test_unsupported_deepspeed_is_refused(version):
    with pytest.raises(RuntimeError, match=rf"deepspeed >=0\.19\.8,<0\.20\.0; found {re.escape(version)}"):
        deepspeed_internals.check_version(version)
    deepspeed_internals.check_version("0.19.8")


def test_build_engine_on_a_world_of_one():
    """`glm53_ds.build_engine(model, ds_config)` with no layout: world 1 set up, AdamW over DeepSpeed's MoE groups
    (hyperparameters from the config's optimizer section), the patches installed, a step that trains."""
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine = glm53_ds.build_engine(model, ds_config)
    # a typed handle; DeepSpeed's object carries nothing of glm53_ds's (before issue 28 it held glm53_layout,
    # glm53_fp32_params and glm53_grad_sync, read back with getattr)
    assert isinstance(engine, Glm53Engine) and engine.module is model and engine.fp32_params is None
    assert engine.layout.world_size == 1 and engine.gradient_sync is False
    assert not [k for k in vars(engine.ds) if k.startswith("glm53")]
    assert isinstance(engine.optimizer, torch.optim.AdamW)
    groups = engine.optimizer.param_groups
    assert {g["lr"] for g in groups} == {1e-3} and len(groups) == 3  # decay, no decay, one expert group
    assert all(
        g.get("moe", False) == all(getattr(p, "allreduce", True) is False for p in g["params"])
        for g in groups
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("experts" in n for n in moved) and any("self_attention" in n for n in moved)


def _gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm", encoding="utf-8").read())
        except OSError:
            pass  # a thread that ended meanwhile
    return sum("gloo" in name for name in names)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_a_closed_engine_and_world_leave_no_thread_behind(engines_not_tracked):
    """Before: an engine outlived every reference (DeepSpeed's gradient hooks hold its optimizer from C++), so its
    model and process groups did too: each in-process engine left ~50-100 gloo threads polling (a full test run
    reached 2,400 threads). Now `Glm53Engine.close` + `close_distributed` free them; the control, the same without
    `close`, keeps them."""
    import gc

    from megatron.core import parallel_state

    from glm53_ds.engine import close_distributed, init_distributed
    from tests.model_fixtures import engine_config

    unclosed = []

    def left_after(close: bool) -> int:
        before = _gloo_threads()
        model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
        engine = glm53_ds.build_engine(model, engine_config(2, True, 1.0))
        if close:
            engine.close()
        else:
            unclosed.append(engine.ds)  # DeepSpeed's engine only: closed below, after counting
        del engine, model
        parallel_state.destroy_model_parallel()
        close_distributed()
        gc.collect()
        return _gloo_threads() - before

    closed, kept = left_after(close=True), left_after(close=False)
    init_distributed()  # DeepSpeed's destroy speaks through the world: the control's engine released in one
    unclosed.pop().destroy()
    close_distributed()
    gc.collect()
    assert closed <= 3, closed  # gloo's few process-wide threads, started once
    assert kept >= 40, kept  # the control


def test_an_optimizer_mixing_experts_and_replicas_is_refused():
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="param group 0 mixes expert and non-expert parameters"):
        glm53_ds.build_engine(model, {"train_micro_batch_size_per_gpu": 1}, optimizer=optimizer)


def test_a_build_lock_left_by_a_killed_rank_does_not_hang_the_next_run(tmp_path):
    """DeepSpeed JIT-loads its CPU comm op through torch's FileBaton (`<build dir>/lock`, created and removed on every
    load). A rank killed inside that window left the file, and every later run waited for it forever (CI: every
    training test after one killed two-rank test timed out, then the suite hung). `load_cpu_comm_op` loads it under
    a kernel lock a dead process releases, and removes such a leftover. Control: DeepSpeed's own load still hangs."""
    import shutil
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    deepspeed_internals.load_cpu_comm_op()  # built once in the usual place, then copied: no second compile
    built = _get_build_directory("deepspeed_shm_comm", verbose=False)
    if not os.path.exists(os.path.join(built, "deepspeed_shm_comm.so")):
        pytest.skip("this accelerator has no shared-memory comm op")
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock", "*.lock"))
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")  # what a killed rank leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}

    def load(call: str, timeout: float) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, env=env, cwd=ROOT,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None

    stock = (
        "import importlib; importlib.import_module('deepspeed.comm.torch').build_shm_op(); print('loaded')"
    )
    assert load(stock, timeout=20) is None  # the control: DeepSpeed's load waits for the leftover lock
    ours = "from glm53_ds.engine.deepspeed_internals import load_cpu_comm_op; load_cpu_comm_op(); print('loaded')"
    proc = load(ours, timeout=300)
    assert proc is not None and proc.returncode == 0 and "loaded" in proc.stdout, proc and proc.stderr[-2000:]
    assert "a build lock left by a killed run" in proc.stderr
    assert not (tmp_path / "deepspeed_shm_comm" / "lock").exists()


def test_a_run_waiting_for_another_processs_op_build_says_so(tmp_path):
    """Before: a run started while another process built DeepSpeed's CPU comm op waited up to minutes in silence.
    Here this process holds the build's lock; the run says what it waits for, then loads once the lock is free."""
    import fcntl
    import shutil
    import subprocess
    import sys
    import time

    from torch.utils.cpp_extension import _get_build_directory

    deepspeed_internals.load_cpu_comm_op()
    built = _get_build_directory("deepspeed_shm_comm", verbose=False)
    if not os.path.exists(os.path.join(built, "deepspeed_shm_comm.so")):
        pytest.skip("this accelerator has no shared-memory comm op")
    copy = tmp_path / "deepspeed_shm_comm"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "*.lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "LOCAL_RANK": "0"}
    call = "from glm53_ds.engine.deepspeed_internals import load_cpu_comm_op; load_cpu_comm_op(); print('loaded')"
    with open(copy / "glm53_ds.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's build, in progress
        proc = subprocess.Popen([sys.executable, "-c", call], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=ROOT)  # fmt: skip
        assert proc.stderr is not None
        line = proc.stderr.readline()
        while line and "waiting for" not in line:
            line = proc.stderr.readline()
        assert "waiting for another process's build of DeepSpeed's deepspeed_shm_comm op" in line, line
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting while the lock is held
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "loaded" in out, err[-2000:]
    assert "building" not in err  # built already: nothing to build


def test_importing_the_engine_on_a_cpu_machine_prints_no_accelerator_warning():
    """Before: every rank of every CPU run printed DeepSpeed's 'Setting accelerator to CPU' warning. The engine
    package names the accelerator DeepSpeed would pick itself. Control: DeepSpeed imported alone still warns."""
    import subprocess
    import sys

    if torch.accelerator.is_available():
        pytest.skip("a machine with an accelerator: DeepSpeed picks it without a warning")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}

    def run(code: str) -> subprocess.CompletedProcess:
        probe = "; import os; from deepspeed.accelerator import get_accelerator; get_accelerator(); print(os.environ.get('DS_ACCELERATOR'))"
        proc = subprocess.run([sys.executable, "-c", code + probe], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    ours, alone = run("import glm53_ds.engine"), run("import deepspeed")
    assert (
        ours.stdout.splitlines()[-1] == "cpu"
        and "Setting accelerator to CPU" not in ours.stdout + ours.stderr
    )
    # control: DeepSpeed alone guesses, and says so (its logger writes to stdout)
    assert (
        alone.stdout.splitlines()[-1] == "None"
        and "Setting accelerator to CPU" in alone.stdout + alone.stderr
    )
