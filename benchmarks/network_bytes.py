"""The planner's network model (glm53_ds/plan/network.py) against the bytes a CPU multi-rank step moves.

Each layout runs the trainer (`deepspeed launch/train.py`, gloo, the tiny model) for 2 and for 3 steps with every
torch.distributed collective wrapped: the bytes leaving each rank are counted from the collective's arguments (ring
algorithms: all-reduce 2 (N-1)/N, reduce-scatter and all-gather (N-1)/N of the whole tensor, all-to-all the splits
for other ranks) by the group's ranks; the third step's bytes are the difference, averaged over the ranks. The
model's bytes for the same run (`backend="gloo"`) are summed over the groups with those ranks (under folding one
set of ranks can be SP and EP at once). Goal: every group within 5%, and the total. The model leaves out the
scalars (losses, token counts, gradient norms, the router-bias update): a group that moves under 0.5% of the step's
bytes is listed, not compared.

    python3 benchmarks/network_bytes.py [--layouts ep2,sp2,ep2sp2,ep2etp2,zero2]

Last line: `network_bytes worst=<largest relative error over groups and layouts>`; JSON in
benchmarks/results/network_bytes_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--model-config", "tiny", "--micro-batch-size", "2", "--seq-length", "128"]  # fmt: skip
GLOBAL_BATCH = "8"  # unless a layout gives its own
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "ep2": (2, ["--ep", "2"]),
    "sp2": (2, ["--sp", "2"]),
    "ep2sp2": (4, ["--ep", "2", "--sp", "2"]),
    "ep2etp2": (4, ["--ep", "2", "--etp", "2"]),
    "ep2_full_recompute": (2, ["--ep", "2", "--recompute", "full"]),
    "zero2": (4, ["--ep", "2", "--deepspeed_config", "{zero2}"]),
    "ep2sp2_bf16_zero2": (4, ["--ep", "2", "--sp", "2", "--deepspeed_config", "{ds}/zero2_bf16.json"]),
    "ep2etp2_bf16_zero1": (
        4,
        [
            "--ep",
            "2",
            "--etp",
            "2",
            "--global-batch-size",
            "16",
            "--deepspeed_config",
            "{ds}/zero1_bf16.json",
        ],
    ),
}
SMALL = 0.005  # a group moving under 0.5% of the step's bytes (scalars the model leaves out) is not compared
ZERO2_FP32 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}  # fmt: skip


def _count_as_rank(out: str, argv: list[str]) -> None:
    """In a rank: wrap the collectives, run the trainer, write {group ranks: bytes sent} at its end."""
    import torch.distributed as dist

    sent: dict[str, float] = {}

    def ranks(group: Any) -> tuple[int, ...]:
        return (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(dist.get_world_size()))
        )

    def arg(a: tuple, k: dict, i: int, name: str) -> Any:
        return k[name] if name in k else a[i]

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    def all_to_all_single(a: tuple, k: dict, n: int) -> float:
        x = arg(a, k, 1, "input")
        splits = k.get("input_split_sizes") or (a[3] if len(a) > 3 else None)
        row = nbytes(x) / max(x.shape[0], 1) if x.dim() else 0
        if splits:
            me = dist.get_rank(k.get("group"))
            return row * (sum(splits) - splits[me])
        return nbytes(x) * (n - 1) / n

    rules = {
        "all_reduce": lambda a, k, n: 2 * (n - 1) / n * nbytes(arg(a, k, 0, "tensor")),
        "all_to_all_single": all_to_all_single,
        "all_gather": lambda a, k, n: (n - 1) * nbytes(arg(a, k, 1, "tensor")),
        "all_gather_into_tensor": lambda a, k, n: (n - 1) / n * nbytes(arg(a, k, 0, "output_tensor")),
        "reduce_scatter_tensor": lambda a, k, n: (n - 1) / n * nbytes(arg(a, k, 1, "input")),
        "broadcast": lambda a, k, n: nbytes(arg(a, k, 0, "tensor")) * (n > 1),
    }

    def wrap(name: str, rule: Any) -> None:
        original = getattr(dist, name)

        def counted(*a: Any, **k: Any) -> Any:
            group = k.get("group")
            members = ranks(group)
            key = json.dumps(sorted(members))
            sent[key] = sent.get(key, 0.0) + rule(a, k, len(members))
            return original(*a, **k)

        setattr(dist, name, counted)

    for name, rule in rules.items():
        wrap(name, rule)
    import glm53_ds.training.main as trainer_main

    close = trainer_main.close_distributed

    def dump_then_close(*a: Any, **k: Any) -> Any:
        with open(f"{out}.{os.environ['RANK']}.json", "w", encoding="utf-8") as f:
            json.dump(sent, f)
        return close(*a, **k)

    trainer_main.close_distributed = dump_then_close  # type: ignore[assignment]
    sys.argv = [os.path.join(ROOT, "launch", "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _measure(world: int, args: list[str], steps: int, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, f"count{steps}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["deepspeed", "--num_gpus", str(world), "--master_port", str(_port()), os.path.abspath(__file__),
           "--as-rank", out, "--", *COMMON, *args, "--train-iters", str(steps), "--output-dir",
           os.path.join(tmp, f"o{steps}")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    total: dict[str, float] = {}
    for r in range(world):
        with open(f"{out}.{r}.json", encoding="utf-8") as f:
            for key, value in json.load(f).items():
                total[key] = total.get(key, 0.0) + value / world
    return total


def _port() -> int:
    from glm53_ds.parallel.state import free_port

    return free_port()


def _label(ranks: list[int], world: int, keys: dict[str, Any]) -> str:
    """What a set of ranks is in the layout: the kinds whose group of its first rank it is (folding: SP+EP)."""
    kinds = [name for name in ("ETP", "SP", "EP", "expert DP", "DP")
             if [r for r in range(world) if keys[name](r) == keys[name](ranks[0])] == ranks]  # fmt: skip
    return "+".join(kinds + (["replicas"] if ranks == list(range(world)) else [])) or "other"


def _model(world: int, args: list[str]) -> tuple[dict[str, float], Any]:
    """The model's bytes per rank by label (`_label` of the groups of rank 0), and the layout's group keys."""
    from glm53_ds.parallel.layout import group_keys
    from glm53_ds.plan.__main__ import planned_run
    from glm53_ds.plan.counts import count_parameters
    from glm53_ds.plan.network import step_traffic

    cpu = (
        []
        if "--deepspeed_config" in args
        else ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "cpu.json")]
    )
    given = [*COMMON, *args, *cpu, "--world", str(world)]  # the trainer's CPU default: ZeRO 0, fp32
    i = given.index("--global-batch-size")  # not a planner flag (memory does not depend on it); set after
    run, _ = planned_run(given[:i] + given[i + 2 :])
    run = dataclasses.replace(
        run, config=dataclasses.replace(run.config, global_batch_size=int(given[i + 1]))
    )
    c = run.config
    traffic = step_traffic(run, count_parameters(run), backend="gloo")
    keys = group_keys(c.ep, c.etp, c.sp)
    members = {name: [r for r in range(world) if keys[name](r) == keys[name](0)] for name in ("ETP", "SP", "EP",
               "expert DP", "DP")}  # fmt: skip
    members["replicas"] = list(range(world))
    out: dict[str, float] = {}
    for group, nbytes in traffic.by_group.items():
        label = _label(members[group], world, keys)
        out[label] = out.get(label, 0.0) + nbytes
    return out, keys


def compare(layout: str, measured: dict[str, float], model: dict[str, float]) -> list[dict[str, Any]]:
    """One row per group label and the total: the measured and the model's bytes and the relative error (0 for a
    group moving under SMALL of the step's bytes: scalars the model leaves out)."""
    whole = sum(measured.values())
    measured, model = {**measured, "total": whole}, {**model, "total": sum(model.values())}
    rows = []
    for label in sorted(set(measured) | set(model)):
        got, want = measured.get(label, 0.0), model.get(label, 0.0)
        error = 0.0 if max(got, want) < SMALL * whole else abs(got - want) / max(got, 1.0)
        rows.append({"layout": layout, "group": label, "measured_bytes": round(got), "model_bytes": round(want),
                     "error": round(error, 4)})  # fmt: skip
    return rows


def layout_args(name: str, zero2_config: str) -> tuple[int, list[str]]:
    """A layout's world and trainer arguments, `zero2_config` the path of ZERO2_FP32 written as JSON."""
    world, args = LAYOUTS[name]
    args = [a.format(zero2=zero2_config, ds=os.path.join(ROOT, "ds_configs")) for a in args]
    if "--global-batch-size" not in args:
        args += ["--global-batch-size", GLOBAL_BATCH]
    return world, args


def main() -> None:
    if "--as-rank" in sys.argv:
        i = sys.argv.index("--as-rank")
        rest = sys.argv[i + 2 :]
        _count_as_rank(sys.argv[i + 1], rest[1:] if rest[:1] == ["--"] else rest)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    from benchmarks.measure import write_results

    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        zero2 = os.path.join(tmp, "zero2_fp32.json")
        with open(zero2, "w", encoding="utf-8") as f:
            json.dump(ZERO2_FP32, f)
        for name in args.layouts.split(","):
            world, args_of = layout_args(name, zero2)
            before = _measure(world, args_of, 2, tmp)
            after = _measure(world, args_of, 3, tmp)
            measured = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            model, keys = _model(world, args_of)
            by_label: dict[str, float] = {}
            for ranks, nbytes in measured.items():  # each rank's own groups, already averaged over the ranks
                members = json.loads(ranks)
                if len(members) > 1:  # a group of one moves nothing
                    label = _label(members, world, keys)
                    by_label[label] = by_label.get(label, 0.0) + nbytes
            for row in compare(name, by_label, model):
                worst = max(worst, row["error"])
                rows.append(row)
                print(f"{name:>20} {row['group']:<22} measured {row['measured_bytes']:12,}  model "
                      f"{row['model_bytes']:12,}  error {row['error']:6.2%}", flush=True)  # fmt: skip
    path = write_results("network_bytes_cpu", {"rows": rows, "worst": worst, "common": COMMON})
    print(f"results: {path}")
    print(f"network_bytes worst={worst:.4f}")


if __name__ == "__main__":
    main()
