"""Scenarios run on every rank by tests/dist_harness.py (one process per rank, gloo, DeepSpeed on CPU).

Every rank also builds the single-process reference (all experts, EP = ETP = 1) from the same checkpoint and
runs it on the concatenated global batch, so each rank can compare its own shard against the reference.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tests.model_fixtures import rel_err

BATCH = 2  # sequences per rank per micro-batch
SEQ = 24


def _setup(ep: int, etp: int, sp: int = 1):  # type: ignore[no-untyped-def]
    from glm53_ds.engine import init_distributed
    from glm53_ds.parallel import init_layout

    init_distributed()  # the harness sets RANK / WORLD_SIZE / MASTER_*: gloo over this world
    return init_layout(ep, etp, sp=sp)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _models(ckpt: str, layout, dtype: torch.dtype, **overrides: Any):  # type: ignore[no-untyped-def]
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
    shard = layout.expert_shard(ref.glm).shard_state_dict(_full_state(ref))
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in shard.items()}, strict=False)
    return ref, model


def _batch(vocab: int, world: int, seed: int, micro: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (micro, world * BATCH, SEQ), generator=g)


def _local(ids: torch.Tensor, rank: int) -> torch.Tensor:
    return ids[rank * BATCH : (rank + 1) * BATCH]


def _compare_to_reference(
    model, ref, layout, use_grad: bool, worst_names: dict | None = None
) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Max relative error of this rank's params (or grads) vs the reference, split expert / non-expert."""
    from glm53_ds.parallel.expert_shard import expert_tensor_kind

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
        if (tensor_kind := expert_tensor_kind(name)) is not None:
            theirs = shard.shard(tensor_kind, theirs)
        kind = "expert" if tensor_kind is not None else "non_expert"
        err = rel_err(mine.float(), theirs.float())
        if worst_names is not None and err > worst[kind]:
            worst_names[kind] = name
        worst[kind] = max(worst[kind], err)
        abs_key = f"{kind}_abs"
        worst[abs_key] = max(worst.get(abs_key, 0.0), (mine.float() - theirs.float()).abs().max().item())
    return worst


def _engine(model, layout, stage: int, dtype: torch.dtype, optimizer: str, lr: float, patch: bool,
            gas: int = 1, overlap_comm: bool = False, clip: float = 0.0,
            bf16_optimizer: bool = False, sp_reduction: bool = True):  # type: ignore[no-untyped-def]  # fmt: skip
    """An engine through `glm53_ds.build_engine`; `patch=False` is the control (the gradient-sync patch replaced by
    a no-op for this build only); `sp_reduction=False` the SP control (DeepSpeed told no SP: it averages the
    gradients of an SP group's shards instead of summing them)."""
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
    no_sp = {"get_sequence_parallel_world_size": lambda self: 1,
             "get_data_parallel_group": DeepSpeedMpu.get_sequence_data_parallel_group,
             "get_data_parallel_world_size": DeepSpeedMpu.get_sequence_data_parallel_world_size,
             "get_data_parallel_rank": DeepSpeedMpu.get_sequence_data_parallel_rank}  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            build, "install_gradient_sync", build.install_gradient_sync if patch else _no_patch
        ))  # fmt: skip
        if not sp_reduction:
            for name, fn in no_sp.items():
                stack.enter_context(mock.patch.object(DeepSpeedMpu, name, fn))
        engine = glm53_ds.build_engine(model, config, optimizer=make_optimizer, layout=layout)
        if not sp_reduction:
            side = engine.fp32_params
            if side is not None:  # the fp32-kept parameters averaged over SP too
                side.sequence_parallel = 1
        return engine


def _no_patch(*args: Any) -> bool:
    return False


def forward_and_gradients(ckpt: str, ep: int, etp: int) -> dict[str, Any]:
    """Forward equality, then stage-0 fp32 reduced gradients with and without the patch."""
    from glm53_ds.parallel.grad_norm import global_grad_norm

    layout = _setup(ep, etp)
    rank, world = layout.rank, layout.world_size
    out: dict[str, Any] = {"layout": layout.describe()}
    ref, _ = _models(ckpt, layout, torch.float32)
    ids = _batch(ref.glm.vocab_size, world, seed=5)[0]
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
        _, model = _models(ckpt, layout, torch.float32)
        with torch.no_grad():
            out["logits_rel_err"] = rel_err(model(_local(ids, rank)), _local(ref_logits, rank))
        engine = _engine(
            model, layout, stage=0, dtype=torch.float32, optimizer="sgd", lr=0.0, patch=patch, clip=1e9
        )
        loss = engine(_local(ids, rank), labels=_local(ids, rank))
        with torch.no_grad():
            out["loss_rel_err"] = rel_err(loss.detach(), ref(_local(ids, rank), labels=_local(ids, rank)))
        engine.backward(loss)
        key = "patched" if patch else "unpatched"
        out[f"grad_err_{key}"] = _compare_to_reference(model, ref, layout, use_grad=True)
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
    from glm53_ds.layers.moe import update_router_bias
    from glm53_ds.parallel.replicas import ReplicaMismatch, check_replicas

    layout = _setup(ep, etp, sp)
    rank, world = layout.data_rank, layout.data_world
    results = []
    for case in cases:
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
        gas, lr, rate = case.get("gas", 1), case.get("lr", 0.05), case.get("router_rate", 1e-3)
        ref, model = _models(case.get("ckpt", ckpt), layout, dtype)
        engine = _engine(model, layout, case["stage"], dtype, case["optimizer"], lr, case["patch"], gas=gas,
                         overlap_comm=case.get("overlap_comm", False), bf16_optimizer=case.get("bf16_optimizer", False),
                         clip=1e9, sp_reduction=case.get("sp_reduction", True))  # fmt: skip
        norms, ref_norms = [], []
        groups = [{"params": list(ref.parameters())}]
        ref_opt = (
            torch.optim.SGD(groups, lr=lr)
            if case["optimizer"] == "sgd"
            else torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        )
        ref.train()
        initial = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
        for step in range(2):
            ids = _batch(ref.glm.vocab_size, world, seed=100 + step, micro=gas)
            for micro in range(gas):
                x = _local(ids[micro], rank)
                engine.backward(engine(x, labels=x))
                engine.step()
            norm = (
                engine.get_global_grad_norm()
            )  # None where DeepSpeed does not record it (unpatched stage 0)
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
                grad_norm=norms,
                ref_grad_norm=ref_norms,
                param_err=_compare_to_reference(
                    engine.module, ref, layout, use_grad=False, worst_names=(names := {})
                ),
                worst_param=names,
                ref_update=max(rel_err(p.detach().float(), initial[n]) for n, p in ref.named_parameters()),
                update=max(
                    rel_err(p.detach().float(), initial[n])
                    for n, p in engine.module.named_parameters()
                    if not n.endswith(("gate_up_proj", "down_proj"))
                ),
                bias_equal_ref=all(torch.equal(a, b) for a, b in zip(biases, ref_biases, strict=True)),
                bias_moved=any(bool(b.abs().sum() > 0) for b in biases),
                optimizer_type=type(engine.optimizer).__name__,
            )
        )
    return results


def layout_suite(ckpt: str, ep: int, etp: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything for one layout in one launch (process start-up dominates on CPU)."""
    return {"gradients": forward_and_gradients(ckpt, ep, etp), "steps": training_steps(ckpt, ep, etp, cases)}


def checkpoint_roundtrip(
    ckpt: str, ep: int, etp: int, save_dir: str, stages: list[int]
) -> list[dict[str, Any]]:
    return [_checkpoint_roundtrip(ckpt, ep, etp, f"{save_dir}/stage{s}", s) for s in stages]


def _checkpoint_roundtrip(ckpt: str, ep: int, etp: int, save_dir: str, stage: int) -> dict[str, Any]:
    """Train one step, save, train one more; a fresh engine loads the save and repeats that step: parameters
    must match bitwise on every rank, and the expert shards must be in distinct files."""
    import os

    from glm53_ds.engine import load_checkpoint, save_checkpoint

    layout = _setup(ep, etp)
    rank, world = layout.rank, layout.world_size

    def fresh_engine():  # type: ignore[no-untyped-def]
        _, model = _models(ckpt, layout, torch.float32)
        return _engine(model, layout, stage, torch.float32, "adamw", LR_CKPT, patch=True)

    def step(engine, seed):  # type: ignore[no-untyped-def]
        x = _local(_batch(engine.module.glm.vocab_size, world, seed=seed)[0], rank)
        engine.backward(engine(x, labels=x))
        engine.step()

    engine = fresh_engine()
    step(engine, 1)
    saved = _full_state(engine.module)
    save_checkpoint(engine, save_dir, "step1", client_state={"step": 1})
    step(engine, 2)
    continued = _full_state(engine.module)

    resumed = fresh_engine()
    client = load_checkpoint(resumed, save_dir)
    restored_equal = all(torch.equal(v, saved[k]) for k, v in _full_state(resumed.module).items())
    step(resumed, 2)
    after = _full_state(resumed.module)
    files = sorted(os.listdir(os.path.join(save_dir, "step1", "glm53")))
    # Control: DeepSpeed's own model file is one per ETP rank, written by one EP rank: it cannot hold the
    # experts of the other EP ranks sharing that ETP rank.
    ds_file = os.path.join(save_dir, "step1", f"mp_rank_{layout.etp_rank:02d}_model_states.pt")
    ds_state = torch.load(ds_file, map_location="cpu", weights_only=False)["module"]
    ds_complete = all(k in ds_state and torch.equal(ds_state[k].float(), v.float()) for k, v in saved.items())
    return dict(
        ep_rank=layout.ep_rank,
        deepspeed_model_file_complete=ds_complete,
        restored_equal=restored_equal,
        resumed_equal=all(torch.equal(v, continued[k]) for k, v in after.items()),
        client_step=client.get("step"),
        expert_files=[f for f in files if f.startswith("experts_") and f.endswith(".index.json")],
    )


LR_CKPT = 1e-3


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bf16_keeps_fp32(ckpt: str, ep: int, etp: int, save_dir: str) -> dict[str, Any]:
    """bf16 engines (ZeRO-2, and the stage-0 bf16 optimizer) built from an fp32 model: HF's fp32-kept parameters
    are fp32 tensors in the forward pass, equal to the loaded values; other parameters bf16; after two AdamW steps
    they moved and every replica is identical; saved as fp32; a full load restores them and their optimizer state,
    so the next step is bitwise the uninterrupted one; the logits stay close to the fp32 model's."""
    import os

    from glm53_ds.checkpoint import ShardReader
    from glm53_ds.engine import load_checkpoint, save_checkpoint
    from glm53_ds.engine.fp32_params import fp32_kept_names
    from glm53_ds.parallel.replicas import ReplicaMismatch, check_replicas
    from tests.model_fixtures import load_hf_reference

    layout = _setup(ep, etp)
    out: dict[str, Any] = {}
    x = _local(_batch(96, layout.world_size, seed=3)[0], layout.rank)
    hf_bf16 = load_hf_reference(
        ckpt, dtype=torch.bfloat16
    )  # transformers' bf16 model, HF's attention expression
    for stage in (2, 0):

        def engine_for(stage: int = stage):  # type: ignore[no-untyped-def]
            ref, model = _models(
                ckpt, layout, torch.float32, attention_impl="eager"
            )  # fp32, to a bf16 engine
            kept = {
                n: t.detach().clone()
                for n, t in model.state_dict().items()
                if n in set(fp32_kept_names(model))
            }
            engine = _engine(model, layout, stage=stage, dtype=torch.bfloat16, optimizer="adamw", lr=1e-2, patch=True,
                             clip=0.5)  # fmt: skip
            return ref, engine, kept

        def kept_state(engine):  # type: ignore[no-untyped-def]
            return {n: t.detach().clone() for n, t in engine.fp32_params.named}

        def step(engine):  # type: ignore[no-untyped-def]
            engine.backward(engine(x, labels=x))
            engine.step()

        ref, engine, original = engine_for()
        now = kept_state(engine)
        out[f"stage{stage}_kept"] = len(now)
        out[f"stage{stage}_kept_fp32_exact"] = set(now) == set(original) and all(
            t.dtype == torch.float32 and torch.equal(t, original[n]) for n, t in now.items()
        )
        out[f"stage{stage}_others_bf16"] = all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        with torch.no_grad():
            engine.eval()
            ours, theirs = engine(x).float().flatten(), hf_bf16(input_ids=x).logits.float().flatten()
            engine.train()
        out[f"stage{stage}_cosine_to_hf_bf16"] = torch.nn.functional.cosine_similarity(
            ours, theirs, dim=0
        ).item()
        for _ in range(2):
            step(engine)
        after = kept_state(engine)
        out[f"stage{stage}_moved"] = all(
            not torch.equal(after[n], original[n]) for n in after if "conv1d" in n
        )
        try:
            check_replicas(engine.module, layout)
            out[f"stage{stage}_replicas"] = "identical"
        except ReplicaMismatch as e:
            out[f"stage{stage}_replicas"] = str(e)
        directory = os.path.join(save_dir, f"stage{stage}")
        save_checkpoint(engine, directory, "step2")
        stored = dict(ShardReader(os.path.join(directory, "step2", "glm53"), "replicated").items())
        out[f"stage{stage}_saved_fp32_exact"] = all(
            stored[n].dtype == torch.float32 and torch.equal(stored[n], t) for n, t in after.items()
        )
        _, resumed, _ = engine_for()
        load_checkpoint(resumed, directory, "step2")
        out[f"stage{stage}_loaded_exact"] = all(
            torch.equal(t, after[n]) for n, t in kept_state(resumed).items()
        )
        step(engine)
        step(resumed)
        a, b = kept_state(engine), kept_state(resumed)
        out[f"stage{stage}_resumed_step_bitwise"] = all(torch.equal(a[n], b[n]) for n in a)
        out[f"stage{stage}_optimizer"] = type(engine.optimizer).__name__
    return out


# ----------------------------------------------------------------------------- sequence parallelism
SP_AUX_COEF = 0.1  # large enough that the balance loss moves the gradients measurably
SP_SEQ = 32  # divisible by SP = 2 and 4; > index_topk, so the DSA selection is sparse
SP_DOCS = [
    0,
    5,
    13,
    14,
    27,
    32,
]  # packed documents straddling the shard boundaries at SP 2 (16) and 4 (8, 16, 24)


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _gather_tokens(t: torch.Tensor, sequence) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return sequence.gather_tokens(t.detach())


def sp_parity(ckpt: str, sp: int, dtype: str = "float32") -> dict[str, Any]:
    """At world = SP: each sequence mixer, and the whole model (LM + MTP losses, logits, every gradient), under SP
    against the same weights in one process, with and without packed documents that straddle shard boundaries.
    Gradients of a shard are summed over the SP group (what the engine's reduction does)."""
    import glm53_ds
    from glm53_ds.layers.documents import Documents
    from glm53_ds.layers.moe import Glm53MoE
    from glm53_ds.model import Glm53Model
    from glm53_ds.parallel.sequence import SequenceParallel
    from glm53_ds.transformer_config import make_transformer_config

    layout = _setup(1, 1, sp)
    sequence = SequenceParallel.of(layout.pg_collection)
    assert sequence is not None and sequence.size == sp
    ref = glm53_ds.load_hf(ckpt)
    model = Glm53Model(make_transformer_config(ref.glm, torch.float32), mtp=ref.mtp is not None,
                       pg_collection=layout.pg_collection)  # fmt: skip
    model.load_state_dict(ref.state_dict())
    if dtype == "float64":  # rounding vs a real difference: in float64 rounding shrinks by ~1e9
        ref, model = ref.double(), model.double()
        torch.set_default_dtype(torch.float64)
    group = layout.sp_group
    out: dict[str, Any] = {}
    moe_sp = [m for m in model.modules() if isinstance(m, Glm53MoE)]
    for m in moe_sp + [m for m in ref.modules() if isinstance(m, Glm53MoE)]:
        m.seq_aux_loss_coef = SP_AUX_COEF  # the sequence-wise balance loss joins the whole-model comparison

    def grad_err(scale: float = 1.0) -> float:
        worst = 0.0
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            if r.grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            worst = max(worst, rel_err(_sum_over(p.grad, group) * scale, r.grad))
        return worst

    g = torch.Generator().manual_seed(11)
    vocab = ref.glm.vocab_size
    cases = {
        "batch2": dict(ids=torch.randint(1, vocab, (2, SP_SEQ), generator=g), cu=None),
        "packed": dict(ids=torch.randint(1, vocab, (1, SP_SEQ), generator=g), cu=torch.tensor(SP_DOCS)),
    }
    for case, inputs in cases.items():
        ids, cu = inputs["ids"], inputs["cu"]
        labels = ids.clone()
        labels[:, 3] = -100  # an ignored target
        mask = torch.ones_like(ids, dtype=torch.bool)
        docs = None if cu is None else Documents.from_cu_seqlens(cu, SP_SEQ, ids.shape[0])

        # --- each sequence mixer alone: KDA (layer 0), MLA with its own indexer (1), a shared-selection layer (2)
        hidden = torch.randn(SP_SEQ, ids.shape[0], ref.glm.hidden_size, generator=g)
        grad_out = torch.randn(SP_SEQ, ids.shape[0], ref.glm.hidden_size, generator=g)
        selection_ref = selection_sp = None
        for i in (0, 1, 2):
            mine, theirs = model.decoder.layers[i].self_attention, ref.decoder.layers[i].self_attention
            x_ref = hidden.clone().requires_grad_(True)
            x_sp = sequence.shard(hidden, dim=0).clone().requires_grad_(True)
            model.zero_grad(), ref.zero_grad()
            o_ref, sel_ref = theirs(x_ref, attention_mask=mask, documents=docs, shared_topk=selection_ref)
            o_sp, sel_sp = mine(
                x_sp, attention_mask=sequence.shard(mask), documents=docs, shared_topk=selection_sp
            )
            (o_ref * grad_out).sum().backward()
            (o_sp * sequence.shard(grad_out, dim=0)).sum().backward()
            key = f"{case}_layer{i}"
            out[f"{key}_out"] = rel_err(_gather_tokens(o_sp.transpose(0, 1), sequence).transpose(0, 1), o_ref)
            out[f"{key}_input_grad"] = rel_err(
                _gather_tokens(x_sp.grad.transpose(0, 1), sequence).transpose(0, 1), x_ref.grad
            )
            out[f"{key}_param_grad"] = grad_err()
            if sel_ref is not None:
                out[f"{key}_selection_equal"] = bool(torch.equal(sel_sp, sel_ref))
                if case == "batch2":  # control: the indexer on this rank's tokens alone
                    with torch.no_grad():
                        x = x_sp.detach().transpose(0, 1)
                        q_resid = mine.q_a_layernorm(mine.q_a_proj(x))
                        alone = mine.indexer(x, q_resid, sequence.shard(mask))
                    out["control_local_selection_equal"] = bool(
                        torch.equal(alone, sequence.shard(sel_ref)[..., : alone.shape[-1]])
                    )
                out[f"{key}_selection_sparse"] = bool((sel_ref < 0).any())
                selection_ref, selection_sp = sel_ref, sel_sp

        # --- the whole model: LM + MTP losses and every gradient; logits of this rank's tokens
        model.zero_grad(), ref.zero_grad()
        model.train(), ref.train()
        p_ref = ref(ids, labels=labels, cu_seqlens=cu, return_parts=True)
        p_sp = model(ids, labels=labels, cu_seqlens=cu, return_parts=True)
        p_ref.total.backward()
        p_sp.total.backward()
        out[f"{case}_lm_loss"] = rel_err(_sum_over(p_sp.lm, group), p_ref.lm)
        assert p_ref.aux is not None and p_sp.aux is not None
        out[f"{case}_aux_loss"] = rel_err(_sum_over(p_sp.aux, group), p_ref.aux)
        if p_ref.mtp is not None:
            out[f"{case}_mtp_loss"] = rel_err(_sum_over(p_sp.mtp, group), p_ref.mtp)
        out[f"{case}_grad"] = grad_err()
        if case == "batch2":  # control: the mean over the SP group instead of the sum
            out["control_mean_grad"] = grad_err(1 / sp)
            # control: targets from each shard's own tokens only (its last positions lose theirs)
            cut = labels.clone()
            cut[:, SP_SEQ // sp :: SP_SEQ // sp] = -100
            with torch.no_grad():
                shard_only = _sum_over(model(ids, labels=cut, return_parts=True).lm, group)
            out["control_local_targets_loss"] = rel_err(shard_only, p_ref.lm)
            # control: the balance loss from each shard's own routing counts (no sum over the SP group)
            for m in moe_sp:
                m.sequence = None
            with torch.no_grad():
                local_aux = model(ids, labels=labels, return_parts=True).aux
            for m in moe_sp:
                m.sequence = sequence
            out["control_local_aux_loss"] = rel_err(_sum_over(local_aux, group), p_ref.aux)
        counts = _sum_over(model.count_targets(labels, cu_seqlens=cu), group)
        out[f"{case}_counts_equal"] = bool(torch.equal(counts, ref.count_targets(labels, cu_seqlens=cu)))
        model.eval(), ref.eval()
        with torch.no_grad():
            out[f"{case}_logits"] = rel_err(
                model(ids, cu_seqlens=cu), sequence.shard(ref(ids, cu_seqlens=cu))
            )
            if ref.mtp is not None:
                out[f"{case}_mtp_logits"] = max(
                    rel_err(a, sequence.shard(b))
                    for a, b in zip(
                        model.mtp_logits(ids, cu_seqlens=cu), ref.mtp_logits(ids, cu_seqlens=cu), strict=True
                    )  # fmt: skip
                )
    # bad input: a row length SP does not divide, before any work
    try:
        model(ids[:, : SP_SEQ - 1])
        out["bad_length"] = "accepted"
    except ValueError as e:
        out["bad_length"] = str(e)
    try:  # refused: the DSA indexer loss under SP
        Glm53Model(make_transformer_config(ref.glm, torch.float32, indexer_loss_coef=1.0), mtp=False,
                   pg_collection=layout.pg_collection)  # fmt: skip
        out["bad_indexer_loss"] = "accepted"
    except ValueError as e:
        out["bad_indexer_loss"] = str(e)
    return out


def sp_suite(ckpt: str, ep: int, etp: int, sp: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Training steps under SP x EP x ETP against the single-process global batch (one launch)."""
    return {"steps": training_steps(ckpt, ep, etp, cases, sp=sp)}


# ----------------------------------------------------------------------------- layout-free checkpoints
def portable_checkpoint(ckpt: str, ep: int, etp: int, phase: str, save_dir: str, stages: list[int]) -> dict:
    """bf16 engines. phase "save": two AdamW steps, then a checkpoint (tag "a"). phase "load": for each ZeRO stage
    in `stages`, a fresh engine at this layout loads tag "a" (another layout: the layout-free path) and saves it
    again as tag "b_stage<S>" in its own directory, so the test can compare what went in with what came out.
    Loading counts the bytes of replicated optimizer state this rank reads (`replicated_state_read_<S>`, a
    fraction of the stored whole)."""
    import math
    import os

    from glm53_ds.checkpoint import ShardReader
    from glm53_ds.checkpoint.safetensors_file import SafetensorsSet
    from glm53_ds.engine import load_checkpoint, save_checkpoint
    from glm53_ds.parallel.expert_shard import expert_tensor_kind

    layout = _setup(ep, etp)
    out: dict[str, Any] = {}
    read_bytes = [0]
    real_read = SafetensorsSet.read

    def counting_read(self, name, index=()):  # type: ignore[no-untyped-def]
        t = real_read(self, name, index)
        if ":" in name and expert_tensor_kind(name.split(":")[0]) is None:  # replicated optimizer state
            read_bytes[0] += t.numel() * t.element_size()
        return t

    SafetensorsSet.read = counting_read  # type: ignore[method-assign]
    for stage in stages if phase == "load" else [2]:
        _, model = _models(
            ckpt, layout, torch.float32
        )  # fp32 weights in; the engine keeps bf16 + fp32 masters
        engine = _engine(
            model.to(torch.bfloat16), layout, stage, torch.bfloat16, "adamw", LR_CKPT, True, clip=1.0
        )
        out[f"optimizer_{stage}"] = type(engine.optimizer).__name__
        if phase == "save":
            for seed in range(2):
                x = _local(_batch(96, layout.world_size, seed=seed)[0], layout.rank)
                engine.backward(engine(x, labels=x))
                engine.step()
            save_checkpoint(engine, save_dir, "a", client_state={"step": 2})
        else:
            read_bytes[0] = 0
            client = load_checkpoint(engine, save_dir, "a")
            stored = ShardReader(os.path.join(save_dir, "a", "glm53"), "optimizer_replicated")
            whole = sum(4 * math.prod(stored.shape(k)) for k in stored.keys())  # fp32 masters and moments
            out[f"replicated_state_read_{stage}"] = read_bytes[0] / whole
            out[f"client_step_{stage}"] = client.get("step")
            save_checkpoint(engine, f"{save_dir}_stage{stage}", "b", client_state=client)
    return out


def moe_dispatch(ckpt: str, ep: int, etp: int) -> dict[str, Any]:
    """The grouped dispatch under EP x ETP against the single-process reference (loop experts) on the global
    batch, with routing forced (router bias) onto experts 0 and 1 only: every other expert, and every EP rank but
    the first, gets no tokens. Also counts the host syncs of one forward + backward (tokens all real)."""
    from glm53_ds.host_syncs import HostSyncCounter
    from glm53_ds.layers.moe import Glm53MoE

    layout = _setup(ep, etp)
    rank, world = layout.rank, layout.world_size
    ref, model = _models(ckpt, layout, torch.float32)
    for m in (ref, model):
        for layer in m.modules():
            if isinstance(layer, Glm53MoE):
                layer.router.e_score_correction_bias[:2] = 10.0  # selection only: weights stay the scores
                layer.experts.moe_impl = "loop" if m is ref else "grouped"
    ids = _batch(ref.glm.vocab_size, world, seed=11)[0]
    ref.train()
    model.train()
    # Each rank's loss is its local mean, so an expert's gradient sums all ranks' local means (world x the global
    # mean's), times the dispatcher's 1/ETP (moe_dispatch.py: DeepSpeed's expert averaging makes it whole).
    (ref(ids, labels=ids) * (world / etp)).backward()
    with torch.no_grad():
        ref_local = ref(_local(ids, rank), labels=_local(ids, rank))
    with HostSyncCounter(model) as counter:
        loss = model(_local(ids, rank), labels=_local(ids, rank))
        loss.backward()
    out: dict[str, Any] = {"loss_rel_err": rel_err(loss.detach(), ref_local)}
    out["expert_grad_err"] = _compare_to_reference(model, ref, layout, use_grad=True)["expert"]
    shard = layout.expert_shard(ref.glm)
    out["starved_rank"] = shard.first_expert >= 2
    out["expert_grads"] = {
        n: (None if p.grad is None else float(p.grad.abs().max()))
        for n, p in model.named_parameters()
        if n.endswith(("gate_up_proj", "down_proj"))
    }
    out["moe_layers"] = sum(isinstance(m, Glm53MoE) for m in model.modules())
    out["syncs"] = {k: v.syncs for k, v in counter.scopes.items()}
    out["sync_sites"] = counter.summary()["sync_sites"]
    return out
