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
Replicas are always compared bitwise (`check_replicas`).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_world
from tests.model_fixtures import CONFIG_A, save_tiny_hf

LR_ADAM = 1e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    full = tmp_path_factory.mktemp("ep_full")
    calm = tmp_path_factory.mktemp("ep_calm")
    save_tiny_hf(full, CONFIG_A)
    save_tiny_hf(calm, CONFIG_A, matrix_scale=0.3)
    return str(full), str(calm)


def _cases(calm: str, etp: int) -> list[dict]:
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


def _check_steps(results, first_norm_tol: float = 1e-6):
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
            for step, (got, ref) in enumerate(zip(r["grad_norm"], r["ref_grad_norm"], strict=True)):
                tol = (2e-2 if step == 0 else 1e-1) if bf16 else (first_norm_tol if step == 0 else 1e-4)
                assert abs(got - ref) <= tol * ref, r
            if case["optimizer"] == "sgd":
                assert max(err["expert"], err["non_expert"]) <= (5e-2 if bf16 else 1e-5), r
                if not bf16:
                    assert r["bias_equal_ref"], r
            else:
                bound = 4 * case["lr"] + (2**-7 if bf16 else 0.0)
                assert max(err["expert_abs"], err["non_expert_abs"]) <= bound, r


def _run(tmp_path, checkpoints, world, ep, etp):
    full, calm = checkpoints
    results = run_world(world, "layout_suite", tmp_path, ckpt=full, ep=ep, etp=etp, cases=_cases(calm, etp))
    _check_gradients(results, etp)
    _check_steps(results)
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


@pytest.mark.slow
def test_checkpoint_save_load_ep2_etp2(tmp_path, checkpoints):
    """Save after one AdamW step, resume in a fresh engine: bitwise the same parameters, and the next step
    bitwise the same as the uninterrupted run, on every rank (stage 0 and ZeRO-2). Expert shards never share a
    file; DeepSpeed's own model file alone would not restore them (control)."""
    _, calm = checkpoints
    results = run_world(4, "checkpoint_roundtrip", tmp_path / "out", ckpt=calm, ep=2, etp=2,
                        save_dir=str(tmp_path / "ckpt"), stages=[0, 2])  # fmt: skip
    for rank_results in results:
        for r in rank_results:
            assert r["restored_equal"] and r["resumed_equal"], r
            assert r["client_step"] == 1
            assert r["expert_files"] == [
                f"experts_ep{e:03d}_etp{t:03d}.index.json" for e in range(2) for t in range(2)
            ]
            # DeepSpeed's model file of this ETP rank was written by EP rank 0: complete only there
            assert r["deepspeed_model_file_complete"] == (r["ep_rank"] == 0), r


@pytest.mark.slow
def test_bf16_engine_keeps_hf_fp32_parameters_in_fp32(tmp_path, checkpoints):
    """Under bf16 ZeRO-2 and the stage-0 bf16 optimizer at EP2xETP2: HF's fp32-kept parameters (conv1d, dt_bias,
    A_log, mHC base/scale) are fp32 in the forward pass and equal the fp32 values handed in (logits cosine to
    transformers' bf16 model >= 0.9995, HF's attention expression); they train, replicas
    stay identical, checkpoints store them as fp32, and a full load resumes them and their optimizer bitwise."""
    _, calm = checkpoints
    for r in run_world(
        4, "bf16_keeps_fp32", tmp_path, ckpt=calm, ep=2, etp=2, save_dir=str(tmp_path / "ckpt")
    ):
        for stage in (2, 0):
            assert r[f"stage{stage}_kept"] >= 30, r
            assert r[f"stage{stage}_kept_fp32_exact"] and r[f"stage{stage}_others_bf16"], r
            assert r[f"stage{stage}_cosine_to_hf_bf16"] >= 0.9995, r
            assert r[f"stage{stage}_moved"] and r[f"stage{stage}_replicas"] == "identical", r
            assert r[f"stage{stage}_saved_fp32_exact"] and r[f"stage{stage}_loaded_exact"], r
            assert r[f"stage{stage}_resumed_step_bitwise"], r


@pytest.mark.slow
def test_grouped_dispatch_with_starved_experts_and_ranks_ep2_etp2(tmp_path, checkpoints):
    """Grouped experts behind the EP x ETP dispatcher against the single-process loop reference, with routing forced
    onto experts 0 and 1: six experts and the whole second EP rank get no tokens. Their gradients are zeros, not
    missing (ZeRO reduces every expert gradient; a missing one hangs it). Host syncs: the forward's input read plus
    one copy of the split sizes per MoE layer, none in backward."""
    full, _ = checkpoints
    results = run_world(4, "moe_dispatch", tmp_path, ckpt=full, ep=2, etp=2)
    for r in results:
        assert r["loss_rel_err"] <= 1e-5, r
        assert r["expert_grad_err"] <= 1e-5, r
        assert all(v is not None for v in r["expert_grads"].values()), r
        if r["starved_rank"]:
            assert max(r["expert_grads"].values()) == 0.0, r
        layer_syncs = {k: v for k, v in r["syncs"].items() if k.startswith("layer")}
        assert sum(layer_syncs.values()) == r["moe_layers"], r["sync_sites"]
        assert r["syncs"].get("backward", 0) == 0, r["sync_sites"]
        assert r["syncs"].get("outside", 0) == 1, r["sync_sites"]
    assert any(r["starved_rank"] for r in results)
