"""The planner's step-time model (plan/network.py): its bytes per group match what a CPU multi-rank step moved
(measured by benchmarks/network_bytes.py from the collectives' arguments, recorded in
benchmarks/results/network_bytes_cpu.json) within 5% for every layout and group, and a model that leaves out
a term the engine moves is caught; the time and the bounding term follow the links; the planner prints the
block for every recipe and refuses bad link flags in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from benchmarks import network_bytes
from glm53_ds.plan.__main__ import main, planned_run
from glm53_ds.plan.counts import count_parameters
from glm53_ds.plan.network import Traffic, offload_times, step_time, step_traffic
from tests.cli import ROOT

GOAL = 0.05  # the bound: the model within 5% of the measured bytes


def _recorded() -> dict[str, dict[str, float]]:
    with open(os.path.join(ROOT, "benchmarks", "results", "network_bytes_cpu.json"), encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["group"] != "total":
            out.setdefault(row["layout"], {})[row["group"]] = row["measured_bytes"]
    return out


def _worst(tmp_path) -> tuple[float, str]:
    """The largest error of today's model against the recorded measurements, over layouts and groups."""
    zero2 = tmp_path / "zero2_fp32.json"
    zero2.write_text(json.dumps(network_bytes.ZERO2_FP32))
    worst, where = 0.0, ""
    recorded = _recorded()
    assert set(recorded) == set(network_bytes.LAYOUTS), "rerun benchmarks/network_bytes.py"
    for name, measured in recorded.items():
        world, args = network_bytes.layout_args(name, str(zero2))
        model, _ = network_bytes._model(world, args)
        for row in network_bytes.compare(name, measured, model):
            if row["error"] > worst:
                worst, where = row["error"], f"{name} {row['group']}"
    return worst, where


def test_the_model_matches_the_measured_bytes_of_every_layout(tmp_path):
    worst, where = _worst(tmp_path)
    assert worst <= GOAL, (worst, where)


@pytest.mark.parametrize(
    "left_out",
    ["ETP: replicated gradients", "SP: DSA latent gradient", "EP: MoE dispatch and combine"],
)
def test_a_model_that_leaves_out_a_term_is_caught(tmp_path, monkeypatch, left_out):
    """Control: the engine's ETP pre-average of the replicated gradients, the DSA latent's gradient over SP, or the
    MoE's combine left out of the model: some layout's group is then more than 5% off."""
    add = Traffic.add

    def without(self, group, item, nbytes):  # type: ignore[no-untyped-def]
        if f"{group}: {item}" != left_out:
            add(self, group, item, nbytes)

    monkeypatch.setattr(Traffic, "add", without)
    worst, _ = _worst(tmp_path)
    assert worst > GOAL, left_out


def _run(*argv: str):  # type: ignore[no-untyped-def]
    run, _ = planned_run(["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "2", *argv])
    return run, step_traffic(run, count_parameters(run))


def test_zero_2_reduces_every_micro_batch_and_zero_1_once():
    """DeepSpeed 0.19's ZeRO 2 reduces the gradients at each micro-batch's backward, in fp32; ZeRO 1 once per step
    in bf16 (measured: the recorded ep2sp2_bf16_zero2 and ep2etp2_bf16_zero1 layouts)."""
    one, t1 = _run("--world", "8", "--ep", "2", "--zero", "1")
    two, t2 = _run("--world", "8", "--ep", "2", "--zero", "2")
    assert t1.by_item["EP: MoE dispatch and combine"] == t2.by_item["EP: MoE dispatch and combine"]
    key = "replicas: gradients all-reduced"
    assert t2.by_item[key] == 2 * t1.by_item[key]  # fp32 instead of bf16, at 1 micro-batch per step
    bigger = dataclass_replace(two, global_batch_size=4 * 2 * 8)  # 4 micro-batches of 2 per rank
    assert step_traffic(bigger, count_parameters(bigger)).by_item[key] == 4 * t2.by_item[key]


def dataclass_replace(run, **config):  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.replace(run, config=dataclasses.replace(run.config, **config))


def test_a_group_across_nodes_runs_at_the_network_and_may_bound_the_step():
    """The same bytes take NVLink time inside a node and network time across nodes; a slow enough network makes the
    replicas' all-reduce the bound, and tokens/s is the tokens per GPU over the step."""
    run, traffic = _run("--world", "16", "--ep", "2", "--zero", "1")
    inside = step_time(run, traffic, [0] * 16)
    across = step_time(run, traffic, [r // 8 for r in range(16)])
    assert across.groups_s["replicas"] > inside.groups_s["replicas"]
    assert inside.groups_s["EP"] == across.groups_s["EP"]  # EP 2 stays inside a node
    slow = step_time(run, traffic, [r // 8 for r in range(16)], network_gbps=1e-6)
    assert slow.bound == "replicas" and slow.tokens_per_s_per_gpu < across.tokens_per_s_per_gpu
    tokens = 2 * 128  # one micro-batch of 2 x 128 per rank
    assert abs(inside.tokens_per_s_per_gpu * inside.total_s - tokens) < 1e-6 * tokens


def _planned(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flag", ["--mfu 2", "--network-gbps 0", "--nvlink-gbps -1"])
def test_a_bad_link_flag_is_one_error_line(flag):
    code, out, err = _planned("--model-config", "tiny", "--world", "2", *flag.split())
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag.split()[0]} must be"), err
    assert out == ""


def test_every_recipe_gets_a_step_time_and_its_bound():
    """Each recipe's tokens/s per GPU and bounding term, at 8 GPUs per node and the default links (and host, under
    --offload-optimizer cpu), are the rows of
    docs/usage.md's table (the planner's JSON carries the block: tests/plan/test_plan.py)."""
    import glob
    import re

    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        docs = f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml"))):
        run, _ = planned_run(["--config", path])
        counts = count_parameters(run)
        host_s = offload_times(run, counts, min(8, run.world))  # ZeRO-Offload's recipes
        timing = step_time(run, step_traffic(run, counts), [r // 8 for r in range(run.world)], host_s=host_s)
        name = os.path.basename(path)
        row = re.search(rf"^\| `recipes/{re.escape(name)}` \| ([\d,]+) \| ([\w ]+?) \|", docs, re.M)
        assert row, f"docs/usage.md: no step-time row for {name}"
        documented = (int(row[1].replace(",", "")), row[2])
        assert documented == (round(timing.tokens_per_s_per_gpu), timing.bound), name
