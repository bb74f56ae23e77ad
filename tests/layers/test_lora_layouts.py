"""LoRA under EP x ETP x SP x DP on CPU ranks (gloo), against the single-process model with the same adapters on
the global batch (`training_steps` of tests/engine/test_gradient_sync.py with a `lora` case): two optimizer steps
(the first moves only B, B starting at zero; the second both), replicas compared bitwise (the ETP-whole expert
adapters across their ETP group too), the frozen base bitwise unchanged, the adapters within
`_check_steps`' bounds of the reference (fp32 SGD parameters <= 1e-5 relative, AdamW <= 4 lr per element, bf16
as there) and the clipping norm the reference's (first step <= 1e-6 relative, 2e-5 under SP as in
tests/parallel/test_sequence.py: the adapters' norm, each replica and each ETP-whole adapter counted once; stage 0
at EP2 x ETP2 measures 6e-8, and 5.8e-6 when the ETP-whole adapters are counted on every ETP rank). Layouts: EP2 x ETP2 (expert-DP 1), EP2 x SP2 (expert-DP 2); stages 0, 1
and 2 (bf16). Control: DeepSpeed's expert reduction leaving the expert adapters out (they differ between the two
ranks holding the same experts). The merged export's tensors (`merged_state_dict`, W + (alpha / r) B A per shard)
against the reference's: fp32 SGD <= 1e-6 relative, AdamW <= 1e-4.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_world
from tests.engine.test_gradient_sync import LR_ADAM, _check_steps, training_steps
from tests.model_fixtures import add_mtp_tensors, save_tiny_hf
from tests.parallel.test_sequence import CONFIG_SP

RANK = 4


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_ckpt")  # 0.3x matrices (bf16 tracks fp32), with the MTP layer
    save_tiny_hf(path, CONFIG_SP, matrix_scale=0.3)
    add_mtp_tensors(path, seed=7)
    return str(path)


def _cases(control: bool) -> list[dict]:
    cases = [
        dict(stage=0, optimizer="sgd", patch=True, lora=RANK),
        dict(stage=1, optimizer="adamw", patch=True, lr=LR_ADAM, lora=RANK),
        dict(stage=2, optimizer="adamw", patch=True, dtype="bf16", lr=LR_ADAM, lora=RANK),
    ]
    if control:
        cases.append(dict(stage=0, optimizer="sgd", patch=True, lora=RANK, expert_adapters_reduced=False))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("ep, etp, sp", [(2, 2, 1), (2, 1, 2)], ids=["ep2_etp2", "ep2_sp2"])
def test_lora_steps_match_one_process(tmp_path, lora_checkpoint, ep, etp, sp):
    control = sp > 1  # expert-DP 2: the two ranks holding the same experts must agree
    results = run_world(4, training_steps, tmp_path, ckpt=lora_checkpoint, ep=ep, etp=etp, cases=_cases(control),
                        sp=sp)  # fmt: skip
    kept = [{"steps": [s for s in r if s["case"].get("expert_adapters_reduced", True)]} for r in results]
    _check_steps(kept, first_norm_tol=1e-6 if sp == 1 else 2e-5)
    for r in results:
        for s in r:
            assert s["frozen"] > 0 and s["base_unchanged"], s  # the base: frozen, bitwise as loaded
            assert s["update"] > 1e-4, s  # the adapters moved
            if s["case"].get("dtype") != "bf16" and s["case"].get("expert_adapters_reduced", True):
                # the merged export's tensors per shard (W + 2 B A) vs the reference's: 8e-8 after SGD, 1.1e-5 after
                # AdamW (its adapters within 4 lr per element); the control measures 5.6e-4
                assert s["merged_err"] <= (1e-6 if s["case"]["optimizer"] == "sgd" else 1e-4), s
            if not s["case"].get("expert_adapters_reduced", True):  # control
                assert s["replicas"].startswith("replicas differ"), s
                assert ".experts.lora." in s["replicas"], s
