"""`--offload-optimizer cpu` (DeepSpeed's ZeRO-Offload) as the trainer configures it and the planner counts it:
the DeepSpeed config it makes (ZeRO 1 / 2 only, one source for it), what leaves the GPU for the host, and the
planner's host-memory line. (The engine's update against the single-process steps: tests/engine/
test_gradient_sync.py, `_check_offload`.)"""

from __future__ import annotations

import pytest

from glm53_ds.config import Glm53Config
from glm53_ds.plan.counts import count_parameters
from glm53_ds.plan.run import PlannedRun
from glm53_ds.plan.state import host_state_split, state_bytes
from glm53_ds.training.config import SetupError
from glm53_ds.training.run_plan import apply_optimizer_offload, optimizer_offload
from tests.model_fixtures import CONFIG_A


def test_the_deepspeed_config_it_makes_and_refuses():
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    apply_optimizer_offload(ds, "cpu", None)
    assert ds["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu",
        "pin_memory": False,
    }  # no CUDA here
    assert optimizer_offload(ds) == "cpu"
    untouched = {"zero_optimization": {"stage": 0}}
    apply_optimizer_offload(untouched, "none", None)
    assert (
        optimizer_offload(untouched) == "none" and "offload_optimizer" not in untouched["zero_optimization"]
    )
    with pytest.raises(
        SetupError, match=r"^--offload-optimizer cpu needs ZeRO 1 or 2; the default config: ZeRO 0"
    ):
        apply_optimizer_offload({"zero_optimization": {"stage": 0}}, "cpu", None)
    in_file = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(
        SetupError, match=r"^--deepspeed_config z.json: offload_optimizer.device is 'cpu' but "
    ):
        apply_optimizer_offload(in_file, "none", "z.json")
    nvme = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(
        SetupError, match=r"offload_optimizer.device 'nvme': glm53_ds offloads to the host only"
    ):
        apply_optimizer_offload(nvme, "cpu", "z.json")
    # the planner refuses what the trainer refuses, in the same words (one check: option_checks)
    from glm53_ds.plan.__main__ import planned_run

    with pytest.raises(SetupError, match=r"^--offload-optimizer cpu needs ZeRO 1 or 2; the run has ZeRO 0"):
        planned_run(
            ["--model-config", "tiny", "--offload-optimizer", "cpu", "--zero", "0", "--seq-length", "256"]
        )


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("bf16", [True, False])
def test_what_moves_to_the_host(zero, bf16):
    """The fp32 masters, the fp32 gradient partition and the moments leave the GPU (ZeRO 2: the training-dtype
    gradient partition too; ZeRO 1 keeps its whole gradient); the host holds them plus a pinned copy of the
    partition in the training dtype. The weights and the fp32-kept tensors' own optimizer stay."""
    run = PlannedRun.for_model(Glm53Config.from_text_dict(CONFIG_A), zero=zero, bf16=bf16, ep=2, gpus=4)
    counts = count_parameters(run)
    on_gpu = state_bytes(counts, 4, 2, 1, zero, bf16)
    offloaded = state_bytes(counts, 4, 2, 1, zero, bf16, offload=True)
    host = sum(host_state_split(counts, 4, 2, 1, bf16))
    width = 2 if bf16 else 4
    parts = {"replicated": -(-counts.trained["replicated"] // 4), "expert": -(-counts.trained["expert"] // 2)}
    if not bf16:
        parts["fp32_kept"] = -(-counts.trained["fp32_kept"] // 4)
    assert host == (16 + width) * sum(parts.values())
    assert offloaded.weights == on_gpu.weights and offloaded.masters == 0
    kept = 4 * counts.trained["fp32_kept"] if bf16 else 0  # the fp32-kept tensors' gradient, on the GPU
    assert offloaded.moments == 2 * kept
    whole = width * sum(counts.trained[k] for k in parts)
    assert offloaded.gradients == kept + (whole if zero == 1 else 0)
    assert on_gpu.total - offloaded.total == 16 * sum(parts.values()) + (
        width * sum(parts.values()) if zero == 2 else 0
    )
    with pytest.raises(ValueError, match="ZeRO-Offload needs ZeRO 1 or 2"):
        state_bytes(counts, 4, 2, 1, 0, bf16, offload=True)


@pytest.mark.slow
def test_full_sft_at_32k_fits_32_h200_with_the_state_on_the_host():
    """The recipe as shipped (docs/usage.md's numbers): full SFT at 32k on 32 H200 (from 64) with the optimizer state
    on the host fits the GPU and 1.5 TB per node (the issue's goal); its step time holds the host's terms."""
    import json

    from tests.cli import module_run

    proc = module_run("glm53_ds.plan", "--config", "recipes/full_sft_32xh200_32k.toml", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    host, memory, network = result["host"], result["memory"], result["network"]
    assert memory["fits"] and host["fits"] and host["per_node"] <= 1.5e12
    assert (round(memory["total"] / 2**30, 1), round(host["per_rank"] / 2**30, 1)) == (83.2, 168.0)
    assert (
        round(host["per_node"] / 2**30) == 1344
        and host["pinned_per_rank"] + host["pageable_per_rank"] == host["per_rank"]
    )
    assert {k: round(v, 1) for k, v in network["offload_s"].items()} == {"PCIe": 0.8, "host update": 4.8}
    assert round(network["tokens_per_s_per_gpu"]) == 1402
    assert "--offload-optimizer cpu" in result["trainer_flags"]


def test_the_search_counts_the_hosts_memory_under_offload():
    """`search` with --offload-optimizer cpu: a layout whose node's host cannot hold its ranks' optimizer state does
    not fit (before: only the GPU was checked, so the smallest world listed could not start)."""
    import dataclasses

    from glm53_ds.engine import close_distributed
    from glm53_ds.plan.memory import HOST_RESERVE_FRACTION, host_per_node, search

    base = PlannedRun.for_model(Glm53Config.from_text_dict(CONFIG_A), zero=1, bf16=True, ep=1, gpus=2)
    run = dataclasses.replace(base, config=dataclasses.replace(base.config, offload_optimizer="cpu"))
    narrow = dict(
        worlds=(2, 4), zero_stages=(1,), recompute_modes=("none",), max_sp=1, max_etp=1, gpus_per_node=2
    )
    close_distributed()  # the counts' world of one (tests above): the search joins fake worlds of its own
    try:
        unbounded = search(run, **narrow)
        at_two = max(host_per_node(m, 2) for m in unbounded.fitting)
        host = int(0.75 * at_two / (1 - HOST_RESERVE_FRACTION))  # holds 4 GPUs' share per node, not 2 GPUs'
        bounded = search(run, **narrow, host_bytes=host)
    finally:
        close_distributed()
    assert unbounded.world == 2
    assert bounded.world == 4 and all(host_per_node(m, 2) <= 0.75 * at_two for m in bounded.fitting)


def test_pinned_and_pageable_host_memory():
    """Pinned: the fp32 master, its fp32 gradient and the copy in the training dtype, plus (ZeRO 2 accumulating over
    micro-batches) DeepSpeed's gradient sums in the training dtype; pageable: the two fp32 moments."""
    from glm53_ds.plan.state import host_state_split, partition_elements

    run = PlannedRun.for_model(Glm53Config.from_text_dict(CONFIG_A), zero=2, bf16=True, ep=2, gpus=4)
    counts = count_parameters(run)
    n = partition_elements(counts, 4, 2, 1, True)
    assert host_state_split(counts, 4, 2, 1, True, 1, accumulating=True) == (10 * n, 8 * n)
    assert host_state_split(counts, 4, 2, 1, True, 2, accumulating=False) == (10 * n, 8 * n)
    assert host_state_split(counts, 4, 2, 1, True, 2, accumulating=True) == (12 * n, 8 * n)
    n32 = partition_elements(
        counts, 4, 2, 1, False
    )  # fp32: the fp32-kept tensors in DeepSpeed's partition too
    assert n32 > n and host_state_split(counts, 4, 2, 1, False, 2, accumulating=True) == (16 * n32, 8 * n32)


def test_the_host_update_and_the_copies_join_the_step_time():
    """`offload_times`: the PCIe copies (ZeRO 2 sends each micro-batch's gradient partition, ZeRO 1 one), and the
    host update, the slower of DeepSpeedCPUAdam's arithmetic (the node's cores shared by its ranks) and its memory
    traffic; both are terms of the step, and can bound it."""
    import dataclasses

    from glm53_ds.plan.network import HOST_ADAM_BYTES, micro_batches, offload_times, step_time, step_traffic
    from glm53_ds.plan.state import partition_elements

    base = PlannedRun.for_model(Glm53Config.from_text_dict(CONFIG_A), zero=2, bf16=True, ep=2, gpus=4)
    assert offload_times(base, count_parameters(base), 4) == {}  # no offload, no terms
    config = dataclasses.replace(base.config, offload_optimizer="cpu", global_batch_size=32)
    run = dataclasses.replace(base, config=config)
    counts = count_parameters(run)
    n, micro = partition_elements(counts, 4, 2, 1, True), micro_batches(run)
    assert micro == 4
    fast_memory = offload_times(run, counts, 4, pcie_gbps=1.0, host_cores=8, host_gbps=1e9, cpu_adam_rate=1e6)
    assert fast_memory["PCIe"] == pytest.approx((micro + 1) * 2 * n / 1e9)
    assert fast_memory["host update"] == pytest.approx(n / (1e6 * 8 / 4))  # 2 cores per rank
    slow_memory = offload_times(run, counts, 4, host_cores=8, host_gbps=1e-3, cpu_adam_rate=1e6)
    assert slow_memory["host update"] == pytest.approx(4 * n * (HOST_ADAM_BYTES + 2) / 1e6)
    zero1 = offload_times(dataclasses.replace(run, zero=1), counts, 4, pcie_gbps=1.0)
    assert zero1["PCIe"] == pytest.approx(2 * 2 * n / 1e9)  # once down, once up
    timing = step_time(run, step_traffic(run, counts), [0] * 4, host_s=slow_memory)
    assert timing.bound == "host update" and timing.host_s == slow_memory
    assert timing.total_s == pytest.approx(
        timing.compute_s + sum(timing.groups_s.values()) + sum(slow_memory.values())
    )
