"""Expert (EP) and expert-tensor (ETP) parallelism under DeepSpeed on CPU ranks (gloo), against the
single-process model on the concatenated global batch, and the replica gradient-sync patch with its control.

Tolerances (fp32 unless said): logits <= 1e-5 relative; reduced gradients relative to each tensor's largest
reference entry: non-expert (vs the global mean) <= 1e-4, as the single-process gradient parity test; expert shards
(vs the matching slice) <= 1e-5. The non-expert bound is set by fp32 summation order, not by the reduction: the
worst tensor is layer 0's A_log, a sum with heavy cancellation (2.7e-5 at world 8, absolute 4.5e-7; splitting the
same batch eightfold in one process already gives 1.0e-5 with HF's attention expression and 1.4e-5 with SDPA),
while the control without the patch is off by 3.2; clipping norm <= 1e-6 relative (first step); after two SGD steps
parameters <= 1e-5 relative, after two AdamW steps (lr 1e-3) <= 4 lr per element. bf16 (a checkpoint with
0.3x weight scale, where bf16 tracks fp32): replicas bitwise identical; SGD parameters <= 5e-2 relative;
AdamW <= 4 lr + 2^-7 max|p| per element; clipping norm <= 2% relative (first step).
Replicas are always compared bitwise (`check_replicas`). ZeRO-Offload (`--offload-optimizer cpu`,
DeepSpeedCPUAdam on the host): five AdamW steps, <= 2 x 5 lr per element from the reference as above, and within
lr / 20 per element of the same run with the optimizer on the device in fp32, one bf16 step + lr / 4 in bf16
(`_check_offload`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.dist_harness import (
    compare_to_reference,
    global_batch,
    load_models,
    local_rows,
    make_engine,
    run_world,
    setup_ranks,
)
from tests.model_fixtures import rel_err

LR_ADAM = 1e-3


def _cases(calm: str, etp: int, world: int = 4) -> list[dict]:
    cases = [
        # two SGD steps at lr 0.05 move the full-scale checkpoint by 11%: its fp32 rounding differences (gradients
        # within 1e-4, checked above) grow past the 1e-5 parameter bound when the batch is split eightfold (world 8,
        # or world 4 x GAS 2: layer 0's q_proj 3.3e-4 on an AMD EPYC + MKL machine, also at the base commit);
        # on the calm checkpoint 9.1e-8
        dict(stage=0, optimizer="sgd", patch=True, ckpt=calm),
        dict(stage=1, optimizer="adamw", patch=True, lr=LR_ADAM),
        dict(stage=2, optimizer="sgd", patch=True, overlap_comm=True, gas=2, ckpt=calm),
        dict(stage=2, optimizer="adamw", patch=True, lr=LR_ADAM),
        dict(stage=0, optimizer="sgd", patch=True, dtype="bf16", ckpt=calm),
        dict(stage=1, optimizer="sgd", patch=True, dtype="bf16", bf16_optimizer=True, gas=2, ckpt=calm),
        dict(stage=2, optimizer="adamw", patch=True, dtype="bf16", lr=LR_ADAM, ckpt=calm),
    ]
    if etp > 1:  # controls: without the patch ETP peers drift apart
        cases += [
            dict(stage=0, optimizer="sgd", patch=False),
            dict(stage=2, optimizer="sgd", patch=False, dtype="bf16", ckpt=calm),
        ]
    if (
        etp > 1 and world == 4
    ):  # ZeRO-Offload (DeepSpeedCPUAdam on the host partition), each beside its twin on the
        # device (torch AdamW), 5 AdamW steps (`_check_offload`); its control without the gradient-sync patch
        fp32, bf16 = (
            dict(stage=2, lr=LR_ADAM, steps=5),
            dict(stage=1, dtype="bf16", lr=LR_ADAM, ckpt=calm, steps=5),
        )
        cases += [dict(case, optimizer="adamw", patch=True, offload=offload, twin=name)
                  for name, case in (("fp32", fp32), ("bf16", bf16)) for offload in (False, True)]  # fmt: skip
        cases += [dict(stage=2, optimizer="adamw", patch=False, lr=LR_ADAM, offload=True)]
    if (
        world == 8
    ):  # what world 8 adds is data parallelism beside EP x ETP (expert-DP 2, ZeRO over 4 ranks): the
        # cases whose reductions or partitions span it; the others ran at world 4 (CI's two cores run 8 ranks slowly)
        keep = (0, 2, 6, 7)
        cases = [cases[i] for i in keep]
    return cases


def _check_gradients(results, etp):
    for r in results:
        g = r["gradients"]
        assert g["logits_rel_err"] <= 1e-5, g
        assert g["loss_rel_err"] <= 1e-5, g
        assert g["grad_err_patched"]["non_expert"] <= 1e-4, g
        assert g["grad_err_patched"]["expert"] <= 1e-5, g
        assert g["expert_grads_unchanged_by_patch"], g
        assert abs(g["grad_norm_patched"] - g["ref_grad_norm"]) <= 1e-6 * g["ref_grad_norm"], g
        # control: DeepSpeed's stage-0 clipping norm averages per-rank norms, which is not the global norm once
        # experts are split over EP ranks (measured: 2e-5 relative off here; ours is exact to ~1e-7)
        assert abs(g["deepspeed_stage0_clip_norm"] - g["ref_grad_norm"]) > 1e-5 * g["ref_grad_norm"], g
        if etp > 1:  # control: DeepSpeed alone averages over an incomplete group
            assert g["grad_err_unpatched"]["non_expert"] > 1e-2, g
        else:
            assert g["grad_err_unpatched"]["non_expert"] <= 1e-4, g


def _check_steps(results, first_norm_tol: float = 1e-6, sgd_tol: float = 1e-5):
    for rank_result in results:
        for r in rank_result["steps"]:
            case, err = r["case"], r["param_err"]
            if not case["patch"]:
                assert r["replicas"].startswith("replicas differ"), r
                continue
            assert r["replicas"] == "identical", r
            assert r["bias_moved"]
            bf16 = case.get("dtype") == "bf16"
            # first step: identical parameters, so the clipping norm must equal the reference's; the second step's
            # parameters already differ by the previous step's rounding
            for step, (got, ref) in enumerate(zip(r["grad_norm"][:2], r["ref_grad_norm"][:2], strict=True)):
                tol = (2e-2 if step == 0 else 1e-1) if bf16 else (first_norm_tol if step == 0 else 1e-4)
                assert abs(got - ref) <= tol * ref, r
            if case["optimizer"] == "sgd":
                assert max(err["expert"], err["non_expert"]) <= (5e-2 if bf16 else sgd_tol), r
                if not bf16:
                    assert r["bias_equal_ref"], r
            else:
                bound = 2 * case.get("steps", 2) * case["lr"] + (2**-7 if bf16 else 0.0)
                assert max(err["expert_abs"], err["non_expert_abs"]) <= bound, r


def _check_offload(results):
    """ZeRO-Offload: the host update is DeepSpeedCPUAdam's, and after 5 AdamW steps (lr 1e-3) every parameter
    element is its device twin's (torch AdamW on the device, the run otherwise the same) within lr / 20 (fp32), and
    within one bf16 rounding step at that element plus lr / 4 (bf16, below). DeepSpeedCPUAdam's vectorised arithmetic rounds otherwise (fp32: 87% of the elements differ in their
    last bits, measured 7.3e-6 and 5.5e-6), so a bf16 copy whose master lies near a rounding boundary lands one
    step away, of whatever size that step has at the element: measured 1.5e-5 in one run, 4.9e-4 in another (a step
    at an element near 0.1, which failed the former bound of lr / 20 alone), 2.7e-5 beyond one step. Beyond that
    step the bound is lr / 4: a bf16 copy one step apart after the first update feeds the twins' next forwards
    different weights, and AdamW's normalised update of a near-zero gradient can then differ by up to 2 lr a step;
    after KDA's torch path changed its fp32 summation order (sub-chunk products) the same 5 steps measured 1.9e-4
    beyond one step (the fp32 twin, which shows the host update's arithmetic, stays within lr / 20: 5.9e-6). Both
    runs are also held to the single-process steps (`_check_steps`: 2 x steps x lr); the control without the
    gradient-sync patch is caught by its replicas."""
    for rank_result in results:
        offloaded = [r for r in rank_result["steps"] if r["case"].get("offload")]
        assert offloaded and all(r["host_optimizer"] == "DeepSpeedCPUAdam" for r in offloaded)
        diffs = {r["case"]["twin"]: r["twin_diff"] for r in offloaded if "twin" in r["case"]}
        assert set(diffs) == {"fp32", "bf16"}, diffs
        assert (
            diffs["fp32"]["largest"] <= LR_ADAM / 20 and diffs["bf16"]["beyond_one_bf16_step"] <= LR_ADAM / 4
        ), diffs


def _run(tmp_path, checkpoints, world, ep, etp):
    full, calm = checkpoints
    results = run_world(
        world, layout_suite, tmp_path, ckpt=full, ep=ep, etp=etp, cases=_cases(calm, etp, world)
    )
    _check_gradients(results, etp)
    _check_steps(results)
    if etp > 1 and world == 4:
        _check_offload(results)
    return results


@pytest.mark.slow
def test_ep2_etp2_world4(tmp_path, checkpoints):
    _run(tmp_path, checkpoints, world=4, ep=2, etp=2)


@pytest.mark.slow
def test_dp2_ep2_world4(tmp_path, checkpoints):
    _run(tmp_path, checkpoints, world=4, ep=2, etp=1)


@pytest.mark.slow
def test_ep4_world4(tmp_path, checkpoints):
    _run(tmp_path, checkpoints, world=4, ep=4, etp=1)


@pytest.mark.slow
def test_ep2_etp2_dp2_world8(tmp_path, checkpoints):
    _run(tmp_path, checkpoints, world=8, ep=2, etp=2)


def forward_and_gradients(ckpt: str, ep: int, etp: int) -> dict[str, Any]:
    """Forward equality, then stage-0 fp32 reduced gradients with and without the patch."""
    from glm53_ds.parallel.grad_norm import global_grad_norm

    layout = setup_ranks(ep, etp)
    rank, world = layout.rank, layout.world_size
    out: dict[str, Any] = {"layout": layout.describe()}
    ref, _ = load_models(ckpt, layout, torch.float32)
    ids = global_batch(ref.glm.vocab_size, world, seed=5)[0]
    ref.train()
    ref_loss = ref(ids, labels=ids)
    ref_loss.backward()
    with torch.no_grad():
        ref_logits = ref(ids)
    ref_norm = torch.sqrt(
        sum(p.grad.double().square().sum() for p in ref.parameters() if p.grad is not None)
    ).item()

    expert_grads = {}
    for patch in (True, False):
        _, model = load_models(ckpt, layout, torch.float32)
        with torch.no_grad():
            out["logits_rel_err"] = rel_err(model(local_rows(ids, rank)), local_rows(ref_logits, rank))
        engine = make_engine(
            model, layout, stage=0, dtype=torch.float32, optimizer="sgd", lr=0.0, patch=patch, clip=1e9
        )
        loss = engine(local_rows(ids, rank), labels=local_rows(ids, rank))
        with torch.no_grad():
            out["loss_rel_err"] = rel_err(
                loss.detach(), ref(local_rows(ids, rank), labels=local_rows(ids, rank))
            )
        engine.backward(loss)
        key = "patched" if patch else "unpatched"
        out[f"grad_err_{key}"] = compare_to_reference(model, ref, layout, use_grad=True)
        expert_grads[key] = [
            p.grad.clone() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
        ]
        out[f"grad_norm_{key}"] = global_grad_norm(model, layout.pg_collection.tp_ep).item()
        if patch:
            from deepspeed.runtime.utils import clip_grad_norm_

            out["deepspeed_stage0_clip_norm"] = float(
                clip_grad_norm_(list(model.parameters()), 1e9, mpu=engine.mpu)
            )
    out["ref_grad_norm"] = ref_norm
    out["expert_grads_unchanged_by_patch"] = all(
        torch.equal(a, b) for a, b in zip(expert_grads["patched"], expert_grads["unpatched"], strict=True)
    )
    return out


def training_steps(
    ckpt: str, ep: int, etp: int, cases: list[dict[str, Any]], sp: int = 1
) -> list[dict[str, Any]]:
    """Two optimizer steps per case on different global batches; replica identity and reference distance. Under
    SP every rank of an SP group gets the same rows (its data rank's) and computes its shard of them."""
    from glm53_ds.checkpoint.placement import expert_split
    from glm53_ds.parallel.replicas import ReplicaMismatch, check_replicas

    layout = setup_ranks(ep, etp, sp)
    rank, world = layout.data_rank, layout.data_world
    results = []
    for case in cases:
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
        gas, lr, rate = case.get("gas", 1), case.get("lr", 0.05), case.get("router_rate", 1e-3)
        ref, model = load_models(case.get("ckpt", ckpt), layout, dtype)
        if case.get("lora"):  # LoRA adapters of rank case["lora"] on both, the base frozen
            with_lora(ref, model, layout, case["lora"])
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        with contextlib.ExitStack() as stack:
            if case.get("expert_adapters_reduced", True) is False:
                stack.enter_context(expert_adapters_not_reduced(model))
            engine = make_engine(model, layout, case["stage"], dtype, case["optimizer"], lr, case["patch"], gas=gas,
                             overlap_comm=case.get("overlap_comm", False), bf16_optimizer=case.get("bf16_optimizer", False),
                             clip=1e9, sp_reduction=case.get("sp_reduction", True),
                             expert_group=case.get("expert_group"), offload=case.get("offload", False))  # fmt: skip
            steps = _steps(engine, ref, case, lr, gas, rate, rank, world)
        try:
            check_replicas(engine.module, layout)
            replicas = "identical"
        except ReplicaMismatch as e:
            replicas = str(e)
        biases = [m.router.e_score_correction_bias for m in engine.module.modules() if hasattr(m, "router")]
        ref_biases = [m.router.e_score_correction_bias for m in ref.modules() if hasattr(m, "router")]
        results.append(
            dict(
                case=case,
                replicas=replicas,
                **steps,
                param_err=compare_to_reference(
                    engine.module, ref, layout, use_grad=False, worst_names=(names := {})
                ),
                worst_param=names,
                update=max(
                    rel_err(p.detach().float(), steps["initial"][n])
                    for n, p in engine.module.named_parameters()
                    if expert_split(n) is None and n in steps["initial"]
                ),
                base_unchanged=all(
                    torch.equal(p, base[n]) for n, p in engine.module.named_parameters() if n in base
                ),
                frozen=len(base),
                merged_err=merged_error(engine.module, ref, layout) if case.get("lora") else None,
                bias_equal_ref=all(torch.equal(a, b) for a, b in zip(biases, ref_biases, strict=True)),
                bias_moved=any(bool(b.abs().sum() > 0) for b in biases),
                optimizer_type=type(engine.optimizer).__name__,
                host_optimizer=type(getattr(engine.optimizer, "optimizer", None)).__name__,
                twin_diff=_twin_diff(case, engine.module),
            )
        )
        results[-1].pop("initial")
    return results


_TWINS: dict[str, dict[str, torch.Tensor]] = {}  # a rank's parameters after each device twin, by twin name


def _twin_diff(case: dict[str, Any], model: torch.nn.Module) -> dict[str, float] | None:
    """For an offloaded case: the largest difference of any parameter element from its device twin's (run just
    before on this rank), and the largest by which one exceeds a bf16 rounding step at that element (the spacing
    of bf16 values at the larger of the two magnitudes); the twin's parameters are kept for it."""
    if "twin" not in case:
        return None
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if not case["offload"]:
        _TWINS[case["twin"]] = params
        return None
    device = _TWINS.pop(case["twin"])
    largest = beyond = 0.0
    for name, twin in device.items():
        diff = (params[name] - twin).abs()
        # values in [2^(e-1), 2^e) lie 2^(e-8) apart in bf16 (8 significant bits)
        exponent = torch.frexp(torch.maximum(params[name].abs(), twin.abs())).exponent
        step = torch.ldexp(torch.ones_like(diff), exponent - 8)
        largest = max(largest, float(diff.max()))
        beyond = max(beyond, float((diff - step).clamp_min(0).max()))
    return dict(largest=largest, beyond_one_bf16_step=beyond)


def _steps(engine, ref, case, lr, gas, rate, rank, world) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Two optimizer steps of `engine` and of the single-process reference on the same global batches."""
    from glm53_ds.layers.moe import update_router_bias

    norms, ref_norms = [], []
    groups = [{"params": [p for p in ref.parameters() if p.requires_grad]}]
    ref_opt = (
        torch.optim.SGD(groups, lr=lr)
        if case["optimizer"] == "sgd"
        else torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    )
    ref.train()
    initial = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    for step in range(case.get("steps", 2)):
        ids = global_batch(ref.glm.vocab_size, world, seed=100 + step, micro=gas)
        for micro in range(gas):
            x = local_rows(ids[micro], rank)
            engine.backward(engine(x, labels=x))
            engine.step()
        norm = engine.get_global_grad_norm()  # None where DeepSpeed does not record it (unpatched stage 0)
        norms.append(None if norm is None else float(norm))
        ref_opt.zero_grad()
        (ref(ids.flatten(0, 1), labels=ids.flatten(0, 1))).backward()
        ref_norms.append(
            torch.sqrt(
                sum(p.grad.double().square().sum() for p in ref.parameters() if p.grad is not None)
            ).item()
        )
        ref_opt.step()
        update_router_bias(engine.module, rate=rate)
        update_router_bias(ref, rate=rate, reduce=False)
    ref_update = max(rel_err(p.detach().float(), initial[n]) for n, p in ref.named_parameters())
    return dict(grad_norm=norms, ref_grad_norm=ref_norms, ref_update=ref_update, initial=initial)


def with_lora(ref, model, layout, rank: int) -> None:  # type: ignore[no-untyped-def]
    """The same LoRA adapters (layout-independent initial values) on the reference and this rank's model, the base
    frozen on both; B starts at zero, so the first step moves only B and the second both."""
    from glm53_ds.layers.lora import LoraSpec
    from glm53_ds.layers.lora_targets import apply_lora
    from glm53_ds.training.trainable import select_trainable

    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    apply_lora(ref, spec)
    apply_lora(model, spec, etp_group=layout.etp_group if layout.etp > 1 else None)
    for m in (ref, model):
        select_trainable(m, lora=True, trainable=None, freeze=None, train_indexer=False)


def merged_error(model, ref, layout) -> float:  # type: ignore[no-untyped-def]
    """The merged export's tensors on this rank (`merged_state_dict`: W + (alpha / r) B A per shard) against this
    rank's part of the reference's: max relative error over the adapted weights."""
    from glm53_ds.checkpoint.placement import expert_split, local_part
    from glm53_ds.layers.lora import merged_state_dict

    mine, theirs = merged_state_dict(model), merged_state_dict(ref)
    shard = layout.expert_shard(ref.glm)
    adapted = {n.split(".lora.")[0] for n, _ in model.named_parameters() if ".lora." in n}
    names = [
        n for n, t in mine.items() if t is not None and (n.rsplit(".", 1)[0] in adapted or expert_split(n))
    ]
    return max(rel_err(mine[n].float(), local_part(n, theirs[n], shard).float()) for n in names)


@contextlib.contextmanager
def expert_adapters_not_reduced(model):  # type: ignore[no-untyped-def]
    """Control (stage 0): DeepSpeed's expert-gradient reduction leaves the expert adapters out, as a port that
    does not tag them as expert parameters of the expert-data-parallel group would."""
    from unittest import mock

    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._get_gradients_for_reduction
    adapters = [p for n, p in model.named_parameters() if ".experts.lora." in n]

    def without_adapters(self):  # type: ignore[no-untyped-def]
        dense, experts = original(self)
        skip = {p.grad.data_ptr() for p in adapters if p.grad is not None}
        return dense, {k: [g for g in v if g.data_ptr() not in skip] for k, v in experts.items()}

    with mock.patch.object(DeepSpeedEngine, "_get_gradients_for_reduction", without_adapters):
        yield


def layout_suite(ckpt: str, ep: int, etp: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything for one layout in one launch (process start-up dominates on CPU)."""
    return {"gradients": forward_and_gradients(ckpt, ep, etp), "steps": training_steps(ckpt, ep, etp, cases)}
