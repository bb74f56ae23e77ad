"""Run a scenario function on N CPU ranks (gloo), forked from the tests' fork server (tests/forked_processes.py),
and collect each rank's result.

A scenario is a module-level function of the test module that uses it (not named `test_*`), passed as itself:
each child imports its module and calls it with the keyword arguments, on every rank; what it returns must be JSON.
The building blocks scenarios share (a layout, models loaded from one checkpoint, a DeepSpeed engine, batches,
the comparison with one process) are at the end of this file.

The parent picks one free port and passes it to every child (a port derived per child would hang the
rendezvous). Each child writes its result as JSON; a child's exception is re-raised in the parent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from glm53_ds.compat.deepspeed_shm import remove_buffers
from glm53_ds.parallel.state import free_port
from tests.forked_processes import context, take_environment
from tests.model_fixtures import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(
    rank: int, world: int, port: int, scenario: tuple[str, str], kwargs: dict[str, Any], out_dir: str,
    env: dict[str, str],
) -> None:  # fmt: skip
    take_environment(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1",
    )  # fmt: skip
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        import torch

        torch.set_num_threads(1)
        module, name = scenario
        result = getattr(importlib.import_module(module), name)(**kwargs)
        payload = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = {"ok": False, "error": traceback.format_exc()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    if payload[
        "ok"
    ]:  # a finished rank's groups, destroyed before teardown (see engine.build.close_distributed)
        from glm53_ds.engine import close_distributed

        close_distributed()
    if not payload["ok"]:
        raise SystemExit(1)


def _launch(
    world: int, scenario: tuple[str, str], out_dir: str, timeout: float, kwargs: dict[str, Any]
) -> list[dict]:
    """One attempt: start every rank, stop all of them as soon as one fails (the others would wait forever in a
    collective), return each rank's payload (or a placeholder for a rank that wrote none)."""
    import time

    ctx = context()
    port = free_port()
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            os.remove(path)
    procs = [
        ctx.Process(target=_child, args=(r, world, port, scenario, kwargs, str(out_dir), dict(os.environ)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    remove_buffers(port)  # DeepSpeed's /dev/shm buffers of ranks that did not exit cleanly
    payloads = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                payloads.append(json.load(f))
        else:
            payloads.append({"ok": False, "error": f"no result (exit code {procs[rank].exitcode})"})
    return payloads


def run_world(
    world: int, scenario: Callable[..., Any], out_dir: str, timeout: float = 900, **kwargs: Any
) -> list[Any]:
    """Run `scenario(**kwargs)` on `world` ranks; every rank's result, in rank order.

    A rendezvous port taken between choosing and binding it (EADDRINUSE) is retried with a new port."""
    from tests.conftest import refuse_in_the_fast_lane

    refuse_in_the_fast_lane(f"starts {world} ranks (tests/dist_harness.py)")
    if not callable(scenario) or scenario.__name__.startswith("test_"):
        raise TypeError(f"run_world: the scenario is a module-level function (not a test), got {scenario!r}")
    os.makedirs(out_dir, exist_ok=True)
    for _attempt in range(3):
        payloads = _launch(world, (scenario.__module__, scenario.__name__), str(out_dir), timeout, kwargs)
        if not any(
            "EADDRINUSE" in p.get("error", "") or "address already in use" in p.get("error", "")
            for p in payloads
        ):
            break
    errors = [f"rank {r}:\n{p['error']}" for r, p in enumerate(payloads) if not p["ok"]]
    if errors:
        raise RuntimeError(f"{scenario.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return [p["result"] for p in payloads]


BATCH = 2  # sequences per rank per micro-batch
SEQ = 24


def setup_ranks(ep: int, etp: int, sp: int = 1):  # type: ignore[no-untyped-def]
    from glm53_ds.engine import init_distributed
    from glm53_ds.parallel import init_layout

    init_distributed()  # the harness sets RANK / WORLD_SIZE / MASTER_*: gloo over this world
    return init_layout(ep, etp, sp=sp)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_models(ckpt: str, layout, dtype: torch.dtype, **overrides: Any):  # type: ignore[no-untyped-def]
    import glm53_ds
    from glm53_ds.model import Glm53Model
    from glm53_ds.transformer_config import make_transformer_config

    ref = glm53_ds.load_hf(ckpt)
    config = make_transformer_config(
        ref.glm,
        dtype=dtype,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        **overrides,
    )
    model = Glm53Model(config, mtp=ref.mtp is not None, pg_collection=layout.pg_collection)
    shard = layout.expert_shard(ref.glm).shard_state_dict(full_state(ref))
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in shard.items()}, strict=False)
    return ref, model


def global_batch(vocab: int, world: int, seed: int, micro: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (micro, world * BATCH, SEQ), generator=g)


def local_rows(ids: torch.Tensor, rank: int) -> torch.Tensor:
    return ids[rank * BATCH : (rank + 1) * BATCH]


def compare_to_reference(
    model, ref, layout, use_grad: bool, worst_names: dict | None = None
) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Max relative error of this rank's params (or grads) vs the reference, split expert / non-expert."""
    from glm53_ds.checkpoint.placement import expert_split, local_part

    shard = layout.expert_shard(ref.glm)
    ref_params = dict(ref.named_parameters())
    # HF's fp32-kept parameters are buffers of a bf16 engine (engine/fp32_params.py): compared too
    kept = [(n, b) for n, b in model.named_buffers() if n in ref_params]
    worst = {"expert": 0.0, "non_expert": 0.0}
    for name, p in list(model.named_parameters()) + kept:
        r = ref_params[name]
        mine, theirs = (p.grad, r.grad) if use_grad else (p.detach(), r.detach())
        if (
            theirs is None or mine is None
        ):  # frozen indexer (HF's no_grad indexer); kept buffers after the step
            continue
        kind = "non_expert" if expert_split(name) is None else "expert"  # the expert LoRA adapters too
        theirs = local_part(name, theirs, shard)
        err = rel_err(mine.float(), theirs.float())
        if worst_names is not None and err > worst[kind]:
            worst_names[kind] = name
        worst[kind] = max(worst[kind], err)
        abs_key = f"{kind}_abs"
        worst[abs_key] = max(worst.get(abs_key, 0.0), (mine.float() - theirs.float()).abs().max().item())
    return worst


def make_engine(model, layout, stage: int, dtype: torch.dtype, optimizer: str, lr: float, patch: bool,
            gas: int = 1, overlap_comm: bool = False, clip: float = 0.0,
            bf16_optimizer: bool = False, sp_reduction: bool = True,
            expert_group: str | None = None, offload: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
    """An engine through `glm53_ds.build_engine`; `patch=False` is the control (the gradient-sync patch replaced by
    a no-op for this build only); `sp_reduction=False` the SP control (DeepSpeed told no SP: it averages the
    gradients of an SP group's shards instead of summing them); `expert_group="pure_dp"` the folding control
    (DeepSpeed's expert-data-parallel group is the layout's `pure_dp_group`, not the ranks holding the same
    experts); `offload`: ZeRO-Offload (`--offload-optimizer cpu`: the AdamW given becomes DeepSpeedCPUAdam)."""
    from unittest import mock

    import glm53_ds
    from glm53_ds.engine import build
    from glm53_ds.engine.mpu import DeepSpeedMpu

    def make_optimizer(groups):  # type: ignore[no-untyped-def]
        if optimizer == "sgd":
            return torch.optim.SGD(groups, lr=lr)
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {
            "stage": stage,
            "contiguous_gradients": True,
            "overlap_comm": overlap_comm,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
        },  # fmt: skip
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    if bf16_optimizer:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    no_sp = {"get_sequence_parallel_world_size": lambda self: 1,
             "get_data_parallel_group": DeepSpeedMpu.get_sequence_data_parallel_group,
             "get_data_parallel_world_size": DeepSpeedMpu.get_sequence_data_parallel_world_size,
             "get_data_parallel_rank": DeepSpeedMpu.get_sequence_data_parallel_rank}  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            build, "install_gradient_sync", build.install_gradient_sync if patch else no_patch
        ))  # fmt: skip
        if not sp_reduction:
            for name, fn in no_sp.items():
                stack.enter_context(mock.patch.object(DeepSpeedMpu, name, fn))
        if expert_group is not None:
            layout = dataclasses.replace(layout, expert_dp_group=getattr(layout, f"{expert_group}_group"))
        engine = glm53_ds.build_engine(model, config, optimizer=make_optimizer, layout=layout)
        if not sp_reduction:
            side = engine.fp32_params
            if side is not None:  # the fp32-kept parameters averaged over SP too
                side.sequence_parallel = 1
        return engine


def no_patch(*args: Any) -> bool:
    return False


LR_CKPT = 1e-3


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def sum_over(t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def gather_tokens(t: torch.Tensor, sequence) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return sequence.gather_tokens(t.detach())
