"""Several hosts on this machine (tools/fake_nodes.py: network, UTS, PID and mount namespaces, an address on a veth
pair only): DeepSpeed's own launcher in each node with `--hostfile --no_ssh --node_rank --master_addr`, no
`*_SOCKET_IFNAME` given. Two nodes train as one node of the same ranks; a node that dies or freezes ends every
surviving rank within `--dist-timeout`, each with one line naming the vanished node and the last whole checkpoint;
restarting both nodes resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from glm53_ds.parallel.state import free_port
from tests.cli import DIE_DURING_SAVE, HANG_TIMEOUT, ROOT, TRAIN, deepspeed_run, metrics

sys.path.insert(0, os.path.join(ROOT, "tools"))
from fake_nodes import FakeNodes  # noqa: E402


@pytest.fixture
def nodes(request):
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    made = FakeNodes(2, name=f"g53t{os.getpid() % 10000}", subnet=200 + os.getpid() % 50)
    try:
        made.up()
    except RuntimeError as e:
        pytest.skip(str(e))
    made.started = []  # type: ignore[attr-defined]
    yield made
    for proc in made.started:  # type: ignore[attr-defined]  # whatever a failed test left running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    made.down()


def _launch(nodes: FakeNodes, k: int, hostfile: str, port: int, *args: str, env: dict | None = None,
            local: tuple[str, ...] = (), script: str = TRAIN) -> subprocess.Popen:  # fmt: skip
    argv = ["deepspeed", "--hostfile", hostfile, "--no_ssh", "--node_rank", str(k), "--master_addr",
            nodes.address(0), "--master_port", str(port), script, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(nodes.command(k, argv, local), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    getattr(nodes, "started", []).append(proc)
    return proc


def _launch_round_robin(nodes: FakeNodes, k: int, world: int, port: int, *args: str) -> subprocess.Popen:
    """Node k's ranks started one process each, numbered round-robin over the nodes (rank k, k + nodes, ...) as
    `srun --distribution=cyclic` numbers them, with the variables a per-task wrapper sets, and no launcher."""
    ranks = range(k, world, nodes.count)
    common = (f"WORLD_SIZE={world} MASTER_ADDR={nodes.address(0)} MASTER_PORT={port} "
              f"{sys.executable} {TRAIN} {' '.join(args)}")  # fmt: skip
    # every rank in the background and each one's status waited for by its pid (a rank that failed early still
    # fails the node)
    script = "".join(f"RANK={r} LOCAL_RANK={i} {common} & pid{i}=$!; " for i, r in enumerate(ranks))
    script += "code=0; " + "".join(f"wait $pid{i} || code=1; " for i in range(len(ranks))) + "exit $code"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(nodes.command(k, ["bash", "-c", script]), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    getattr(nodes, "started", []).append(proc)
    return proc


def _run_nodes(nodes: FakeNodes, tmp_path, slots: int, *args: str) -> list[str]:
    hostfile = nodes.hostfile(str(tmp_path), slots)
    port = free_port()
    procs = [_launch(nodes, k, hostfile, port, *args) for k in range(nodes.count)]
    outs = [p.communicate(timeout=HANG_TIMEOUT)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outs


def test_the_interface_to_the_master_is_found_in_a_node(nodes):
    """In a node whose host name resolves to nothing (gloo would fall back to loopback), the interface that routes
    to node 0 is chosen; a master address reached only through loopback is one line naming what to set."""
    probe = ("import importlib.util, os, sys; os.environ['MASTER_ADDR'] = {!r}; "
             "spec = importlib.util.spec_from_file_location('nodes', sys.argv[1]); "
             "nodes = importlib.util.module_from_spec(spec); spec.loader.exec_module(nodes); "
             "print(nodes.choose_socket_interfaces(False)); print(os.environ['GLOO_SOCKET_IFNAME'])")  # fmt: skip
    module = os.path.join(ROOT, "glm53_ds", "engine", "nodes.py")  # alone: no torch to import in each node
    for k in range(2):
        out = subprocess.run(nodes.command(k, [sys.executable, "-c", probe.format(nodes.address(0)), module]), cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
        assert (
            out[-1] == f"{nodes.name}{k}v"
            and f"network: node{k}: collectives over {nodes.name}{k}v" in out[0]
        )
    bad = subprocess.run(nodes.command(1, [sys.executable, "-c", probe.format("127.0.0.1"), module]), cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode != 0 and "reaches it through loopback (127.0.0.1)" in bad.stderr
    assert "set GLOO_SOCKET_IFNAME to the interface of this host (node1)" in bad.stderr


@pytest.mark.slow
def test_a_node_local_save_is_refused_before_any_work(nodes, tmp_path):
    """--save is a directory of node 1's own on that node (a local disk at the same path): one line naming node1
    and the path, on every node, before the model is built."""
    (tmp_path / "ckpt").mkdir()
    hostfile = nodes.hostfile(str(tmp_path), 1)
    port = free_port()
    args = [
        "--ep",
        "2",
        "--train-iters",
        "2",
        "--save",
        str(tmp_path / "ckpt"),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    procs = [
        _launch(nodes, k, hostfile, port, *args, local=(str(tmp_path / "ckpt"),) if k else ())
        for k in range(2)
    ]
    outs = [p.communicate(timeout=HANG_TIMEOUT)[0] for p in procs]
    errors = [line for line in outs[0].splitlines() if "error: " in line]
    assert (
        len(errors) == 1
        and f"--save '{tmp_path / 'ckpt'}': node node1 (rank 1) sees no file node 0 wrote" in errors[0]
    ), outs
    assert "kernels:" not in outs[0] and not os.listdir(tmp_path / "ckpt")


def _same_tensors(a, b, rtol: float) -> list[str]:
    """The stored tensors (model sets, read whole) of checkpoint tags `a` and `b` that differ by more than `rtol` of
    the tensor's largest value, or that one has and the other not."""
    from glm53_ds.checkpoint import CheckpointDir

    x, y = CheckpointDir(str(a)), CheckpointDir(str(b))
    names = x.keys() | y.keys()
    off = sorted(names ^ (x.keys() & y.keys()))
    for name in sorted(x.keys() & y.keys()):
        u, v = x.full_tensor(name).double(), y.full_tensor(name).double()
        if (u - v).abs().max() > rtol * max(u.abs().max().item(), v.abs().max().item(), 1e-30):
            off.append(name)
    return off


@pytest.mark.slow
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_two_nodes_train_as_one_node_and_resume_on_another_layout(nodes, tmp_path, tuning):
    """2 nodes x 2 ranks at EP 2 x SP 2 = 1 node x 4 ranks (losses within 1e-5, the step-2 checkpoints' tensors
    within 1e-5 of their largest value), full and LoRA; the checkpoint resumes on 1 node x 2 ranks (EP 2), step 3
    as the uninterrupted runs', and (full) on the same nodes numbered round-robin by their launcher (renumbered node
    by node), step 3 bitwise the uninterrupted run's."""
    lora = ["--lora-rank", "8"] if tuning == "lora" else []
    common = ["--ep", "2", "--sp", "2", "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "2",
              "--dist-timeout", "120", *lora]  # fmt: skip
    outs = _run_nodes(nodes, tmp_path, 2, *common, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                      "--output-dir", str(tmp_path / "two_nodes"))  # fmt: skip
    assert "network: node1: collectives over" in outs[1]
    one = deepspeed_run(4, *common, "--save", str(tmp_path / "ckpt_one"), "--save-interval", "2", "--output-dir",
                        str(tmp_path / "one_node"))  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = metrics(tmp_path / "two_nodes"), metrics(tmp_path / "one_node")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert (
            abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 * y["lm_loss"]
            and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * y["grad_norm"]
        )
    assert _same_tensors(tmp_path / "ckpt" / "step2", tmp_path / "ckpt_one" / "step2", 1e-5) == []
    assert "placement: 2 nodes x 2 ranks; inside a node: SP 2, EP 2; across nodes: expert DP 2 (2 nodes), " \
        "replicas 4 (2 nodes)" in outs[0]  # fmt: skip
    resumed = deepspeed_run(2, "--ep", "2", "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size",
                            "2", *lora, "--load", str(tmp_path / "ckpt"), "--load-tag", "step2", "--output-dir",
                            str(tmp_path / "resumed"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (last,) = metrics(tmp_path / "resumed")
    assert last["step"] == 3 and abs(last["lm_loss"] - a[2]["lm_loss"]) <= 1e-5 * a[2]["lm_loss"]
    if tuning == "lora":
        return
    # the same nodes started one process per rank, numbered round-robin over them: renumbered node by node (the SP
    # and EP pairs inside a node again), and the checkpoint resumes on them as on the launcher's order
    port = free_port()
    cyclic = [_launch_round_robin(nodes, k, 4, port, *common, "--load", str(tmp_path / "ckpt"), "--load-tag",
                                  "step2", "--output-dir", str(tmp_path / "cyclic")) for k in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=HANG_TIMEOUT)[0] for p in cyclic]
    assert all(p.returncode == 0 for p in cyclic), outs[0][-3000:] + outs[1][-3000:]
    assert (
        "rank order: the launcher numbered ranks across nodes (1->2, 2->1); renumbered node by node"
        in outs[0]
    )
    assert "placement: 2 nodes x 2 ranks; inside a node: SP 2, EP 2;" in outs[0]
    assert (tmp_path / "cyclic" / "metrics.jsonl").is_file(), outs[0][-3000:] + outs[1][-3000:]
    (again,) = metrics(tmp_path / "cyclic")
    assert again["step"] == 3 and again["lm_loss"] == a[2]["lm_loss"], (again, a[2])


def _kill_node_in_a_step(nodes, tmp_path, how: signal.Signals, timeout: int) -> tuple[list[str], float]:
    """Both nodes train (1 rank each, a save every 2 steps); once step 3 is logged, `how` goes to every process of
    node 1; returns node 0's output and how long its ranks took to exit."""
    hostfile = nodes.hostfile(str(tmp_path), 1)
    port = free_port()
    args = ["--ep", "2", "--train-iters", "400", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
            "--output-dir", str(tmp_path / "run"), "--dist-timeout", str(timeout), "--log-interval", "1"]  # fmt: skip
    procs = [_launch(nodes, k, hostfile, port, *args) for k in range(2)]
    begun = time.time()
    while not (tmp_path / "ckpt" / "latest").exists() or len(_records(tmp_path / "run")) < 3:
        assert time.time() - begun < 600 and procs[0].poll() is None, "the run did not reach step 3"
        time.sleep(0.2)
    os.killpg(procs[1].pid, how)  # the node's whole session: its launcher and ranks
    killed = time.time()
    out = procs[0].communicate(timeout=timeout + 120)[0]
    took = time.time() - killed
    if how == signal.SIGSTOP:
        os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].communicate()
    return [out], took


def _records(output_dir) -> list:
    try:
        return metrics(output_dir)
    except (OSError, ValueError):
        return []


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_node_ends_the_run_in_bounded_time_and_the_nodes_resume(nodes, tmp_path, how):
    """Killed: seen at once. Frozen (SIGSTOP: a hung GPU, a cut network): seen after --dist-timeout. Either way every
    surviving rank exits with one line naming node1 and the last whole checkpoint, no traceback; after the kill,
    restarting both nodes resumes from `latest`."""
    timeout = 10
    (out,), took = _kill_node_in_a_step(nodes, tmp_path, how, timeout)
    errors = [line for line in out.splitlines() if "error: " in line]
    assert errors and all("node node1 (ranks 1) vanished" in e for e in errors), out[-4000:]
    assert all(f"the last whole checkpoint is {tmp_path / 'ckpt'}/step" in e for e in errors), errors
    assert "Traceback" not in out, out[-4000:]
    assert took < timeout + 30, took
    if how == signal.SIGSTOP:
        return
    step = int((tmp_path / "ckpt" / "latest").read_text().strip().removeprefix("step"))
    outs = _run_nodes(nodes, tmp_path, 1, "--ep", "2", "--train-iters", str(step + 1), "--load", str(tmp_path / "ckpt"),
                      "--output-dir", str(tmp_path / "again"))  # fmt: skip
    assert [r["step"] for r in metrics(tmp_path / "again")] == [step + 1], outs[0][-3000:]


@pytest.mark.slow
def test_a_node_lost_in_a_save_leaves_latest_whole_and_the_nodes_resume_bitwise(nodes, tmp_path):
    """Node 1 dies whole (its launcher and rank, SIGKILL) inside the save of step 4, after its replicated files and
    before its expert shards and `latest`: node 0's rank exits with one line naming node1 and step2 as the last whole
    checkpoint; `latest` still names step2; both nodes restarted resume from it, steps 3 and 4 bitwise the lost
    run's."""
    hostfile, port, ckpt = nodes.hostfile(str(tmp_path), 1), free_port(), tmp_path / "ckpt"
    common = ["--ep", "2", "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2", "--dist-timeout", "10",
              "--log-interval", "1"]  # fmt: skip
    common += ["--output-dir", str(tmp_path / "run")]
    dies = {"script": DIE_DURING_SAVE, "env": {"GLM53_TEST_DIE": "node"}}
    procs = [
        _launch(nodes, 0, hostfile, port, *common),
        _launch(nodes, 1, hostfile, port, "--die-during-save", "step4", *common, **dies),  # type: ignore[arg-type]
    ]
    outs = [p.communicate(timeout=HANG_TIMEOUT)[0] for p in procs]
    assert procs[0].returncode != 0 and procs[1].returncode != 0, outs[0][-3000:]
    errors = [line for line in outs[0].splitlines() if "error: " in line]
    assert errors and all(
        "node node1 (ranks 1) vanished" in e and f"the last whole checkpoint is {ckpt}/step2" in e
        for e in errors
    ), outs[0][-4000:]
    assert "Traceback" not in outs[0], outs[0][-4000:]
    assert (ckpt / "latest").read_text().strip() == "step2"
    lost = metrics(tmp_path / "run")
    assert [r["step"] for r in lost] == [1, 2, 3, 4]
    _run_nodes(nodes, tmp_path, 1, *common[:-2], "--load", str(ckpt), "--output-dir", str(tmp_path / "again"))
    resumed = metrics(tmp_path / "again")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(lost[2:], resumed, strict=True):
        assert (a["lm_loss"], a["grad_norm"]) == (b["lm_loss"], b["grad_norm"])
    assert (ckpt / "latest").read_text().strip() == "step4"
