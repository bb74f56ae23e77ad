"""HF's fp32-kept parameters under a bf16 DeepSpeed engine (issue 14), one process: the engine's forward is
`load_hf(dir, bf16)`'s, so its logits stay as close to transformers' bf16 as ours are (cosine >= 0.9995 with HF's
attention expression, both chaotic configs); the control (DeepSpeed's own cast of those parameters) falls to
0.992 / 0.975. Their update is an fp32 AdamW update of the reduced, clipped gradients. Multi-rank: test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm53_ds
from glm53_ds.engine import build
from glm53_ds.engine.fp32_params import fp32_kept_names
from tests.model_fixtures import CONFIG_A, CONFIG_B, batch, load_hf_reference, save_tiny_hf

CONFIGS = {"A": CONFIG_A, "B": CONFIG_B}


def _ds_config(stage: int = 2, clip: float = 0.0) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}  # fmt: skip


@pytest.fixture(scope="module", params=["A", "B"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fp32_{request.param}")
    save_tiny_hf(path, CONFIGS[request.param])
    return path


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).float()


def test_bf16_engine_forward_is_load_hf_bf16(hf_dir, monkeypatch):
    ids, mask, _ = batch(96, s=30, padding="right")
    hf = load_hf_reference(hf_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits.float()[mask].flatten()
    bf16 = glm53_ds.load_hf(str(hf_dir), dtype=torch.bfloat16, attention_impl="eager").eval()
    model = glm53_ds.load_hf(str(hf_dir), attention_impl="eager")  # fp32, handed to the bf16 engine
    kept = {n: t.detach().clone() for n, t in model.state_dict().items() if n in set(fp32_kept_names(model))}
    engine = glm53_ds.build_engine(model, _ds_config())
    engine.eval()
    state = engine.module.state_dict()
    assert len(kept) >= 20 and all(
        state[n].dtype == torch.float32 and torch.equal(state[n], kept[n]) for n in kept
    )
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    ours = _logits(engine, ids, mask)
    assert torch.equal(ours, _logits(bf16, ids, mask))
    cosine = F.cosine_similarity(ours[mask].flatten(), ref, dim=0).item()
    assert cosine >= 0.9995, cosine

    # control: the old path (DeepSpeed casts those parameters to bf16)
    class NoFp32Params(build.Fp32Params):
        def __init__(self, model):  # type: ignore[no-untyped-def]
            self.slots, self.optimizer, self._square_norm = [], None, None

    monkeypatch.setattr(build, "Fp32Params", NoFp32Params)
    control = glm53_ds.build_engine(glm53_ds.load_hf(str(hf_dir), attention_impl="eager"), _ds_config())
    control.eval()
    cosine = F.cosine_similarity(_logits(control, ids, mask)[mask].flatten(), ref, dim=0).item()
    assert cosine < 0.9995, cosine


@pytest.mark.parametrize("stage", [2, 0])
def test_fp32_params_take_an_fp32_adamw_step_of_the_clipped_gradient(hf_dir, stage):
    """Two AdamW steps (lr 1e-2, weight decay 0.1, clipping active) equal an fp32 reference AdamW over the same
    tensors given the same reduced gradients and the engine's global norm; 1-D tensors do not decay."""
    model = glm53_ds.load_hf(str(hf_dir))
    engine = glm53_ds.build_engine(
        model, _ds_config(stage, clip=0.05),
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    )  # fmt: skip
    side = engine.fp32_params
    reference = [t.detach().clone().requires_grad_(True) for t in side.tensors]
    named = list(zip([n for n, _ in side.named], reference, strict=True))
    ref_opt = torch.optim.AdamW(
        build.decay_groups(named), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    assert any(g.get("weight_decay") == 0.0 for g in ref_opt.param_groups)
    grads: list[list[torch.Tensor]] = []
    reduce = side.reduce

    def recording_reduce():  # type: ignore[no-untyped-def]
        out = reduce()
        grads.append([t.grad.clone() for t in side.tensors])
        return out

    side.reduce = recording_reduce
    for seed in range(2):
        ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(ids, labels=ids))
        engine.step()
        norm = float(engine.get_global_grad_norm())
        assert norm**2 >= float(sum(g.double().square().sum() for g in grads[-1]))  # the norm includes them
        clip = (norm + 1e-6) / 0.05
        assert clip > 1  # clipping active
        for t, g in zip(reference, grads[-1], strict=True):
            t.grad = g / clip
        ref_opt.step()
    initial = dict(glm53_ds.load_hf(str(hf_dir)).state_dict())
    for (name, t), r in zip(side.named, reference, strict=True):
        assert t.dtype == torch.float32
        assert (t - r).abs().max().item() <= 1e-6 * max(r.abs().max().item(), 1.0), name
    assert all(not torch.equal(t, initial[n]) for n, t in side.named if "conv1d" in n)  # they trained
