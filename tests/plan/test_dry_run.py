"""The real-size dry run (plan/dry_run.py): the released GLM-5.3-Flash, 45 layers, 288 experts, MTP, on meta tensors
as one rank of EP 32 x ETP 2 (and of EP 8 x SP 8 on 8 ranks with LoRA: the experts folded over the SP ranks), forward and backward of 131,072 tokens, natively and through a
stock megatron GPTModel built from the specs; the index arithmetic at 1,048,576 positions. Each run is its own
process (it joins a fake world of its layout's size). Controls: the int32 audit, the shard check and the gradient
check each catch the fault they look for.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from glm53_ds.layers.kda_ops import kda_attention
from glm53_ds.parallel.expert_shard import ExpertShard
from glm53_ds.plan.counts import count_parameters
from glm53_ds.plan.dry_run import INT32_LIMIT, Int32Audit, gradient_problems, shard_problems
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import glm53_flash, tiny
from tests.cli import module_run

RELEASED_ELEMENTS_PER_RANK = {(32, 2): 13_975_432_958}  # the planner's count, restated by the run


def run_dry(*args: str) -> dict:
    proc = module_run("glm53_ds.plan.dry_run", "--json", *args, timeout=900)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and report["problems"] == [], report["problems"] or proc.stderr[-3000:]
    return report


@pytest.mark.slow
def test_released_model_at_ep32_etp2_128k_tokens():
    report = run_dry("--ep", "32", "--etp", "2", "--seq-length", "131072")
    assert report["parameters_held"] == report["planned_held"] == RELEASED_ELEMENTS_PER_RANK[(32, 2)]
    assert report["local_experts"] == 288 // 32 and report["loss_shape"] == []
    assert report["int32_ops"] == {}
    # 128k tokens: the sparse attention's q_lat [1, 131072, 64, 512] is past 2^31 elements, KDA's operands are not
    assert report["kernel_elements"]["DSA sparse attention (Triton)"] == 131072 * 64 * 512
    assert report["kernel_elements"]["KDA (fla chunk_kda)"] == 131072 * 64 * 128 <= INT32_LIMIT


@pytest.mark.slow
def test_released_model_with_lora_at_ep8_sp8_128k_tokens():
    report = run_dry("--ep", "8", "--sp", "8", "--seq-length", "131072", "--lora-rank", "16", "--rank", "5")
    planned = count_parameters(PlannedRun.for_model(glm53_flash(), ep=8, lora_rank=16))
    assert report["parameters_held"] == sum(planned.held(k) for k in planned.trained)
    assert report["local_experts"] == 36 and report["sp"] == 8
    assert report["trained_tensors"] > 0 and report["int32_ops"] == {}
    # each rank attends with all 64 heads for its 131072 / 8 queries (over the whole row's latent)
    assert report["kernel_elements"]["DSA sparse attention (Triton)"] == 131072 // 8 * 64 * 512


@pytest.mark.slow
def test_the_indexer_loss_at_the_released_size_under_sp():
    """Full SFT at EP 8 x SP 8, 128k tokens, the first 4 layers (KDA and DSA, dense MLP and MoE) and MTP, with the
    indexer loss: every indexer tensor trains and gets a gradient of its shape (`gradient_problems`: none), no int32
    arithmetic. Control: the same run without the loss trains fewer tensors (the indexer is then frozen), so the
    gradient check covered the indexer's. (It found the loss's target computed one query per block at this width,
    16,384 iterations per layer: about 75 s for the two runs, 9 s since.)"""
    base = ["--ep", "8", "--sp", "8", "--seq-length", "131072", "--layers", "4"]
    with_loss = run_dry(*base, "--indexer-loss-coef", "0.1")
    without = run_dry(*base)
    assert with_loss["indexer_loss_coef"] == 0.1 and with_loss["int32_ops"] == {}
    assert with_loss["trained_tensors"] > without["trained_tensors"] > 0


@pytest.mark.slow
def test_released_model_through_megatrons_gpt_model_128k_tokens():
    report = run_dry("--ep", "32", "--etp", "2", "--seq-length", "131072", "--gpt-model", "--rank", "63")
    assert report["parameters_held"] == RELEASED_ELEMENTS_PER_RANK[(32, 2)] and report["int32_ops"] == {}


@pytest.mark.slow
def test_index_arithmetic_at_1m_positions():
    """max_position_embeddings = 1,048,576 tokens in one sequence, one layer of each kind (KDA + dense MLP, DSA +
    MoE) and MTP: no int32 arithmetic anywhere in forward or backward, and the kernels' operands that pass 2^31
    elements are the ones the project's Triton kernels address in int64. The loss head in chunks of 1 GiB of
    logits: the same operations as the default 256 MiB (its tiles still chunks of rows within vocabulary slices),
    in a quarter of the loop, which was most of this test's time."""
    report = run_dry(
        "--ep", "32", "--etp", "2", "--seq-length", str(2**20), "--layers", "4", "--loss-chunk-mib", "1024"
    )
    assert report["int32_ops"] == {}
    assert report["kernel_elements"]["DSA sparse attention (Triton)"] == 2**20 * 64 * 512 > INT32_LIMIT
    assert report["kernel_elements"]["KDA (fla chunk_kda)"] == 2**20 * 64 * 128 > INT32_LIMIT


def test_the_triton_kernels_address_rows_in_int64():
    """What lets the sparse-attention and mHC kernels pass 2^31 elements: each kernel's row / token program id is
    promoted to int64 before it multiplies a stride (the other grid axis counts blocks of one row)."""
    import inspect

    from glm53_ds.layers import sparse_attention_triton
    from glm53_ds.mhc import hc_post_triton

    for module in (sparse_attention_triton, hc_post_triton):
        lines = [ln.strip() for ln in inspect.getsource(module).splitlines() if "tl.program_id(0)" in ln]
        assert lines and all(ln.endswith("tl.program_id(0).to(tl.int64)") for ln in lines), lines


def test_int32_audit_catches_int32_arithmetic():
    with Int32Audit() as audit:
        positions = torch.arange(8, device="meta").to(torch.int32)  # stored as int32: fine
        _ = positions.long() * 4096  # arithmetic in int64: fine
    assert audit.computed == {}
    with Int32Audit() as audit:
        _ = positions * 4096  # int32 arithmetic: overflows past 2^31
    assert audit.computed == {"mul": 1}


def test_shard_check_catches_a_wrong_shard():
    import glm53_ds

    cfg = tiny()
    whole = {n: p.shape for n, p in glm53_ds.build_model(cfg).named_parameters()}
    with torch.device("meta"):
        model = glm53_ds.build_model(cfg)
    assert shard_problems(model, whole, ExpertShard.for_config(cfg, 1, 0, 1, 0)) == []
    problems = shard_problems(
        model, whole, ExpertShard.for_config(cfg, 2, 1, 1, 0)
    )  # EP 2 wants half the experts
    assert problems and all(".experts." in p for p in problems)


def test_gradient_check_catches_a_missing_gradient():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0](torch.ones(1, 4)).sum().backward()  # model[1] never used
    assert [p.split(":")[0] for p in gradient_problems(model)] == ["1.weight", "1.bias"]


def test_the_kernel_ops_on_meta_check_the_contract_and_are_recorded():
    """On meta tensors the model's KDA and sparse-attention calls are their ops' meta implementations: the contract's
    shape checks, the outputs' shapes, gradients shaped as the inputs; the dry run records each kernel's largest
    operand by the op it sees, and the planner adds the DSA backward's transient buffers at its backward op (the
    control: without that declaration the peak misses exactly them)."""
    from glm53_ds import backends
    from glm53_ds.layers import fused_kernels
    from glm53_ds.layers.dsa_workspace import backward_workspace
    from glm53_ds.layers.sparse_attention import sparse_latent_attention
    from glm53_ds.plan.activations import LiveBytes
    from glm53_ds.plan.dry_run import KernelOperands

    q = torch.empty(1, 8, 2, 4, device="meta")
    with KernelOperands() as operands:
        out = kda_attention(
            q, q, torch.empty(1, 8, 2, 6, device="meta"), q, torch.empty(1, 8, 2, device="meta")
        )
    assert out.shape == (1, 8, 2, 6) and operands.largest == {"KDA (fla chunk_kda)": 96}
    with pytest.raises(
        ValueError, match=r"KDA beta: shape \(1, 8\), the kernel's contract needs \(1, 8, 2\)"
    ):
        kda_attention(q, q, q, q, torch.empty(1, 8, device="meta"))

    impl = backends.resolve(
        backends.ATTENTION, "auto", torch.device("meta")
    )  # the GPU's kernel, as mla.py does

    def backward_peak(q_lat, latent, tokens) -> int:
        out = sparse_latent_attention(q_lat, latent, tokens, 0.1, impl=impl, blind_possible=False)
        with LiveBytes() as live:
            live.mark()
            out.sum().backward()
        return live.highest

    shapes = ((2, 64, 4, 32), (2, 64, 32), (2, 64, 16))
    q_lat, latent = (torch.empty(s, device="meta", requires_grad=True) for s in shapes[:2])
    tokens = torch.empty(shapes[2], dtype=torch.int32, device="meta")
    with KernelOperands() as operands:
        out = sparse_latent_attention(q_lat, latent, tokens, 0.1, impl=impl, blind_possible=False)
        out.sum().backward()
    assert out.shape == q_lat.shape and q_lat.grad.shape == q_lat.shape and latent.grad.shape == latent.shape
    assert impl == "triton" and operands.largest == {"DSA sparse attention (Triton)": 2 * 64 * 4 * 32}
    workspace = sum(math.prod(s) * d.itemsize for s, d in backward_workspace(2, 64, 4, 32, 16))
    with_it = backward_peak(q_lat, latent, tokens)
    kernel = fused_kernels.KERNELS["glm53::sparse_attention_triton"]
    fused_kernels.KERNELS["glm53::sparse_attention_triton"] = dataclasses.replace(kernel, workspace=None)
    try:
        without = backward_peak(q_lat, latent, tokens)
    finally:
        fused_kernels.KERNELS["glm53::sparse_attention_triton"] = kernel
    assert with_it - without == workspace > 0
    with pytest.raises(ValueError, match=r"sparse attention tokens: shape \(2, 63, 16\)"):
        sparse_latent_attention(q_lat, latent, tokens[:, :63], 0.1, impl=impl)


def test_the_model_files_keep_one_code_path():
    """No model file branches on meta tensors (before: kda_ops.py and sparse_attention.py called shape-only
    stand-ins, and the MoE's experts and dispatch, the DSA indexer and the model's input check skipped their host
    reads on meta): the kernels' ops have meta implementations, and each host read declares its stand-in at the read
    (glm53_ds/host_reads.py). Allowed: host_reads.py itself, the activation offload's host copy (a shape on meta)
    and the backend choice. The control: the check finds the branches the old code had."""
    import pathlib
    import re

    import glm53_ds

    branch = re.compile(r"""device\.type\s*[!=]=\s*["']meta["']|\.is_meta\b|on_meta\(|shape_only\.""")
    root = pathlib.Path(glm53_ds.__file__).parent
    model_half = [root / "model.py", root / "transformer_layer.py", *sorted((root / "layers").rglob("*.py")),
                  *sorted((root / "mhc").rglob("*.py")), *sorted((root / "parallel").rglob("*.py"))]  # fmt: skip
    allowed = {root / "layers" / "activation_offload.py"}
    assert [
        str(p.relative_to(root)) for p in model_half if p not in allowed and branch.search(p.read_text())
    ] == []
    for old in ('    if shape_only.on_meta(q):  # a shape-only dry run',  # kda_ops.py
                '        on_meta = rows.device.type == "meta"  # a shape-only run (plan/): no counts to read',  # experts
                '        if input_ids.numel() and input_ids.device.type != "meta":'):  # fmt: skip  # model.py
        assert branch.search(old), old
