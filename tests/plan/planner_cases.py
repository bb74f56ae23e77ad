"""The planner's numbers for every recipe and every row of the docs' memory tables (docs/usage.md, recipes/README.md),
and for a tiny model with every memory-relevant option set: recorded once (`python -m tests.plan.planner_cases
--record`, into planner_numbers.json) and compared exactly by tests/plan/test_planner_numbers.py, so that a change
to how the planner is driven (its flags, run files, the typed run it plans) cannot move a number unseen."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMBERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planner_numbers.json")

_LORA = ("--lora-rank", "16", "--zero", "2", "--recompute", "full")
_H100 = ("--gpu-memory", "80GB")
_FULL = ("--zero", "2")


def _released(world: int, ep: int, etp: int, sp: int, tokens: int, *more: str) -> tuple[str, ...]:
    return ("--world", str(world), "--ep", str(ep), "--etp", str(etp), "--sp", str(sp), "--seq-length",
            str(tokens), *more)  # fmt: skip


CASES: dict[str, tuple[str, ...]] = {
    **{
        f"recipe {os.path.basename(path)}": ("--config", os.path.relpath(path, ROOT))
        for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml")))
    },
    # docs/usage.md, "Long rows on one node": LoRA r16, H200, ZeRO 2, full recompute, EP 8 (x SP 8)
    "lora 8k ep8": _released(8, 8, 1, 1, 8192, *_LORA),
    "lora 8k ep8 offload": _released(8, 8, 1, 1, 8192, *_LORA, "--offload-activations"),
    "lora 16k ep8": _released(8, 8, 1, 1, 16384, *_LORA),
    "lora 16k ep8 offload": _released(8, 8, 1, 1, 16384, *_LORA, "--offload-activations"),
    "lora 32k ep8": _released(8, 8, 1, 1, 32768, *_LORA),
    "lora 32k ep8 offload": _released(8, 8, 1, 1, 32768, *_LORA, "--offload-activations"),
    "lora 32k ep8 offload tiles": _released(
        8, 8, 1, 1, 32768, *_LORA, "--offload-activations", "--moe-tile-mib", "1024"
    ),  # fmt: skip
    "lora 32k ep8 sp8": _released(8, 8, 1, 8, 32768, *_LORA),
    "lora 64k ep8 sp8 offload": _released(8, 8, 1, 8, 65536, *_LORA, "--offload-activations"),
    "lora 128k ep8 sp8 offload": _released(8, 8, 1, 8, 131072, *_LORA, "--offload-activations"),
    # docs/usage.md, "LoRA on the FP8 download": the base resident in block-FP8 (--base-quant fp8)
    "lora 32k ep8 sp8 fp8": _released(8, 8, 1, 8, 32768, *_LORA, "--base-quant", "fp8"),
    "lora 128k ep8 sp8 fp8": _released(8, 8, 1, 8, 131072, *_LORA, "--base-quant", "fp8"),
    "lora 128k ep8 sp8 fp8 offload tiles": _released(
        8, 8, 1, 8, 131072, *_LORA, "--base-quant", "fp8", "--offload-activations", "--moe-tile-mib", "1024"
    ),  # fmt: skip
    "lora 32k h100 8 fp8": _released(8, 8, 1, 8, 32768, *_LORA, "--base-quant", "fp8", *_H100),
    "lora 32k h100 8 fp8 offload": _released(
        8, 8, 1, 8, 32768, *_LORA, "--base-quant", "fp8", "--offload-activations", *_H100
    ),  # fmt: skip
    # docs/usage.md, "Will it fit?": the searched rows' layouts
    "full 8k h200 64": _released(64, 32, 2, 4, 8192, *_FULL, "--recompute", "full"),
    "full 8k h200 64 sp8 offload": _released(
        64, 32, 2, 8, 8192, *_FULL, "--recompute", "full", "--offload-activations"
    ),  # fmt: skip
    "full 8k h100 256": _released(256, 32, 2, 16, 8192, *_FULL, "--recompute", "selective", *_H100),
    "full 32k h200 64": _released(64, 32, 2, 16, 32768, *_FULL, "--recompute", "full"),
    "full 32k h100 256": _released(256, 32, 2, 8, 32768, *_FULL, "--recompute", "full", *_H100),
    "full 128k h200 128": _released(128, 32, 1, 16, 131072, *_FULL, "--recompute", "full"),
    "lora 8k h100 16": _released(16, 16, 1, 4, 8192, *_LORA, *_H100),
    "lora 32k h200 8 sp4": _released(8, 8, 1, 4, 32768, *_LORA),
    "lora 32k h100 16": _released(16, 16, 1, 16, 32768, *_LORA, *_H100),
    "lora 128k h100 32": _released(32, 32, 1, 16, 131072, *_LORA, *_H100),
    # docs/usage.md, ZeRO-Offload: full SFT at 8k on 16 H200 fits a node of 4 TB (and not one of 2 TB)
    "full 8k h200 16 offload 4TB": (
        "--config",
        "recipes/full_sft_32xh200_8k.toml",
        "--gpus",
        "16",
        "--ep",
        "16",
        "--zero",
        "2",
        "--host-memory",
        "4TB",
    ),  # fmt: skip
    # the planner's defaults (ZeRO 1, no recompute) and its hints for a run that does not fit
    "defaults 64 ep32 etp2": _released(64, 32, 2, 1, 8192),
    # a tiny model with every memory-relevant option set
    "tiny every option": (
        "--model-config",
        "tiny",
        "--world",
        "4",
        "--ep",
        "2",
        "--etp",
        "2",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "2",
        "--recompute",
        "selective",
        "--lora-rank",
        "8",
        "--moe-tile-mib",
        "1",
        "--loss-chunk-mib",
        "0",
        "--indexer-loss-coef",
        "0.1",
        "--zero",
        "0",
        "--fp32",
        "--no-mtp",
        "--gpu-memory",
        "1GB",
    ),  # fmt: skip
    "tiny full offload": (
        "--model-config",
        "tiny",
        "--world",
        "8",
        "--ep",
        "4",
        "--sp",
        "2",
        "--seq-length",
        "128",
        "--recompute",
        "full",
        "--offload-activations",
        "--gpu-memory",
        "80GB",
    ),  # fmt: skip
}


# Runs that do not fit whose hints (a trace for each change tried: 15-45 s each) the check leaves out; their numbers
# are compared, and the hints of the other runs that do not fit are.
WITHOUT_HINTS = (
    "defaults 64 ep32 etp2",
    "lora 16k ep8",
    "lora 32k ep8",
    "lora 32k ep8 offload",
    "lora 32k ep8 offload tiles",
    "lora 32k h100 8 fp8",
)


def numbers(argv: tuple[str, ...], hints: bool = True) -> dict:
    """The planner's JSON for `argv`: its numbers and the hints and flags it prints (`hints=False`: the same
    numbers from the planner's own functions, without the hints: `would_fit` None)."""
    from glm53_ds.plan.__main__ import main, planned_run
    from glm53_ds.plan.counts import count_parameters
    from glm53_ds.plan.memory import rank_memory

    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        if hints:
            with contextlib.redirect_stdout(out):
                code = main([*argv, "--json"])
            result = json.loads(out.getvalue())
        else:
            run, _ = planned_run([*argv])
            memory, counts = rank_memory(run), count_parameters(run)
            code = 0 if memory.fits else 1
            result = {"memory": memory.as_dict(), "trainer_flags": run.trainer_flags() + run.run_flags(),
                      "would_fit": None, "parameters": {"total": counts.total, "active": counts.active,
                      "trained": counts.trained, "frozen": counts.frozen, "buffers": counts.buffers}}  # fmt: skip
    finally:
        os.chdir(cwd)
    memory = result["memory"]
    return {
        "code": code,
        "fits": memory["fits"],
        "total": memory["total"],
        "state": memory["state"],
        "activations": memory["activations"],
        "activations_saved": memory["activations_saved"],
        "loss_head": memory["loss_head"],
        "communication": memory["communication"],
        "host_memory": memory["host_memory"],
        "host_state": memory["host_state"],  # --offload-optimizer cpu: pinned and pageable
        "host_state_pageable": memory["host_state_pageable"],
        "activations_by_kind": memory["activations_by_kind"],
        "parameters": result["parameters"],
        "trainer_flags": result["trainer_flags"],
        "would_fit": result["would_fit"],
    }


def recorded() -> dict[str, dict]:
    with open(NUMBERS, encoding="utf-8") as f:
        return json.load(f)


def differences(expected: dict, got: dict, where: str = "") -> list[str]:
    """Every number, flag or hint of `got` that is not `expected`'s (the exit code apart: it was 0 for a run
    that does not fit before the planner's exit codes said so; now 1, `code_problems`)."""
    out = []
    for key in sorted(expected.keys() | got.keys()):
        if key == "code" and not where:
            continue
        a, b = expected.get(key), got.get(key)
        if key == "would_fit" and b is None and not where:  # computed without the hints (WITHOUT_HINTS)
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{where}{key}.")
        elif a != b:
            out.append(f"{where}{key}: recorded {a!r}, now {b!r}")
    return out


def code_problems(got: dict) -> list[str]:
    """The exit code says whether the run fits: 0 when it does, 1 when it does not."""
    want = 0 if got["fits"] else 1
    return (
        []
        if got["code"] == want
        else [f"exit code {got['code']}, {'fits' if got['fits'] else 'does not fit'}"]
    )


def main() -> int:
    """`--record`: write the numbers of every case (or of the named ones); `--check`: compare each case with
    what was recorded, one line per difference, exit 1 on any."""
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(CASES)
    record = "--record" in sys.argv  # records everything, the hints included
    found = {name: numbers(CASES[name], hints=record or name not in WITHOUT_HINTS) for name in names}
    if "--record" in sys.argv:
        with open(NUMBERS, "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1, sort_keys=True)
            f.write("\n")
    problems = []
    if "--check" in sys.argv:
        before = recorded()
        for name, got in found.items():
            problems += [f"{name}: {d}" for d in differences(before[name], got) + code_problems(got)]
    for name, got in found.items():
        print(f"{name}: {got['total'] / 2**30:.2f} GiB, fits {got['fits']}")
    for line in problems:
        print(f"differs: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
