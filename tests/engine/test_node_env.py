"""What a node needs before the process group exists (engine/nodes.py), and who a failed collective lost
(training/peers.py), without starting a world: `.deepspeed_env` applied as DeepSpeed's ssh launch exports it, the
build directory of DeepSpeed's ops keyed by environment, the heartbeat's verdicts on a store."""

from __future__ import annotations

import os
import time

import pytest

from glm53_ds.engine.deepspeed_internals import extensions_dir
from glm53_ds.engine.nodes import apply_deepspeed_env, may_span_nodes
from glm53_ds.training.peers import Heartbeat, is_peer_loss, lost_peers_line, ranges


def test_deepspeed_env_is_applied_under_no_ssh(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr("glm53_ds.engine.nodes.DEEPSPEED_ENV_PATHS", (str(tmp_path / "home"), "."))
    assert apply_deepspeed_env() is None
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5_0\n# a comment\nGLM53_TEST_X=a=b\n")
    monkeypatch.delenv("GLM53_TEST_X", raising=False)
    line = apply_deepspeed_env()
    assert os.environ["GLM53_TEST_X"] == "a=b" and os.environ["NCCL_IB_HCA"] == "mlx5_0"
    assert line is not None and "NCCL_IB_HCA, GLM53_TEST_X set" in line
    (tmp_path / ".deepspeed_env").write_text("no equals sign\n")
    with pytest.raises(OSError, match=r"\.deepspeed_env:1: not KEY=VALUE"):
        apply_deepspeed_env()


@pytest.mark.parametrize(
    "env, spans",
    [
        ({"WORLD_SIZE": "4", "CROSS_SIZE": "2", "LOCAL_SIZE": "2"}, True),  # DeepSpeed's launcher, 2 nodes
        ({"WORLD_SIZE": "4", "CROSS_SIZE": "1", "LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}, False),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, True),  # torchrun, 2 nodes
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}, False),
        ({"WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}, True),  # one process per GPU (srun), no local size
        ({"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}, False),
        ({"WORLD_SIZE": "4", "MASTER_ADDR": "localhost"}, False),
        ({"WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1"}, False),
    ],
)
def test_a_world_that_may_span_nodes_is_told_from_the_launchers_variables(monkeypatch, env, spans):
    """Across nodes the interface is chosen and the ranks' order checked; on one node nothing changes."""
    for name in ("WORLD_SIZE", "CROSS_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert may_span_nodes() is spans


def test_the_op_build_directory_is_keyed_by_environment(monkeypatch, tmp_path):
    """Before: one ~/.cache/torch_extensions/py311_cpu for every virtualenv of Python 3.11: two environments rebuilt
    the op over each other. Now: interpreter, torch and DeepSpeed in the name; another prefix, another directory."""
    import sys

    import deepspeed
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = extensions_dir()
    assert here.startswith(str(tmp_path / "torch_extensions")) and f"torch{torch.__version__}" in here
    assert f"deepspeed{deepspeed.__version__}" in here
    monkeypatch.setattr(sys, "prefix", "/opt/other-venv")
    assert extensions_dir() != here


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.gone = False

    def set(self, key: str, value: str) -> None:
        if self.gone:
            raise RuntimeError("Connection refused")
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        if self.gone:
            raise RuntimeError("Connection refused")
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_the_heartbeat_names_the_silent_node_and_the_last_checkpoint(tmp_path):
    store, hosts = _Store(), ["node0", "node0", "node1", "node1"]
    beats = [Heartbeat(store, r, hosts, period=0.1) for r in range(4)]
    for b in beats:
        b._thread.start()
    time.sleep(0.3)
    beats[2].stop(), beats[3].stop()  # node1 dies
    time.sleep(0.15)
    (tmp_path / "latest").write_text("step4")
    line = lost_peers_line(beats[0], RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:123"), 5, str(tmp_path))  # fmt: skip
    assert line is not None and line.startswith(
        "rank 0 (node0): a collective failed in step 6: node node1 (ranks 2-3) vanished"
    )
    assert f"the last whole checkpoint is {tmp_path / 'step4'} ('latest')" in line
    assert (
        lost_peers_line(beats[0], ValueError("a bug"), 5, None) is None
    )  # not a lost peer: the traceback stays
    store.gone = True  # node 0's store is gone
    assert "node node0 (ranks 0-1) vanished" in beats[2].vanished()
    for b in beats:
        b.stop()
    assert is_peer_loss(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_the_slurm_node_script_launches_each_node_without_ssh(tmp_path):
    """launch/slurm_node.sh as srun runs it on each node (scontrol and deepspeed stand-ins on PATH): node 0 writes
    the allocation's hostfile, every node runs DeepSpeed's launcher with --no_ssh, its SLURM_NODEID and node 0."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu01\\ngpu02\\n'\n")
    (bin_dir / "deepspeed").write_text('#!/bin/sh\necho "deepspeed $*"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[01-02]",
           "GLM53_HOSTFILE": str(tmp_path / "hostfile"), "GPUS_PER_NODE": "4"}  # fmt: skip
    script = os.path.join(root, "launch", "slurm_node.sh")
    outs = [subprocess.run([script, "--ep", "8"], env={**env, "SLURM_NODEID": str(k)}, capture_output=True,
                           text=True, check=True, timeout=60).stdout.strip() for k in (0, 1)]  # fmt: skip
    assert (tmp_path / "hostfile").read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    for k, out in enumerate(outs):
        assert out == (f"deepspeed --hostfile {tmp_path / 'hostfile'} --no_ssh --node_rank {k} --master_addr gpu01 "
                       "--master_port 29500 launch/train.py --ep 8")  # fmt: skip
