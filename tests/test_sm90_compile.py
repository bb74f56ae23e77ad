"""Every Triton kernel compiled for sm_90 (an H100 / H200) on this machine without a GPU, at the released width
(`benchmarks/sm90_compile.py`: a stand-in driver, compile-only launches, the ptxas and cuobjdump inside the Triton
wheel). Asserted for every kernel: it compiles; no bf16 kernel spills registers to local memory inside a loop (read
from the machine code), nor saves more than 128 bytes per thread outside them (values kept once per program);
shared memory fits an sm_90 block (227 KiB). Reported (printed): registers, stack, shared memory, warps, occupancy,
whether the matrix products are Hopper's wgmma, their instruction shapes, and the products every warpgroup computes
whole. The control: a kernel made to spill inside its loop shows it, so a spill would be seen. This is the feedback
loop for kernel work: it runs in the fast lane (about 30 s on a cold Triton cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli import ROOT

COMMON = {
    "indexer_topk_kernel:K128",  # the indexer's streaming top-k at K = 128 (kpool 16) and 512 (kpool 4)
    "indexer_topk_kernel:K512",
    "indexer_topk_kernel:K128:documents",  # over a packed row's documents
    "fwd_kernel",
    "segment_sum_kernel",
    "hc_post_fwd_kernel",
    "hc_post_bwd_kernel",
    "sinkhorn_fwd_kernel",  # fp32 in both runs: mHC's mixing weights are fp32 whatever the activations
    "sinkhorn_bwd_kernel",
    "block_fp8_gemm_kernel",
}
KERNELS = {  # the DSA backward: one fused kernel per query in bf16 (and its atomic alternative), two in fp32
    "bf16": COMMON | {"bwd_query_kernel", "bwd_query_kernel:atomic"},
    "fp32": COMMON | {"bwd_slots_kernel", "bwd_dq_kernel"},
}
WGMMA = ("fwd_kernel", "bwd_query_kernel", "block_fp8_gemm_kernel")  # the DSA and block-FP8 GEMMs' products


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sm90_compile.py"), "--json", "--control"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n".join(result["table"]))  # shown with -s, and in the log of a failure
    return proc.returncode, result


def test_every_kernel_compiles_for_sm90_within_its_limits(compiled):
    code, result = compiled
    kernels = result["kernels"]
    assert {(k["kernel"], k["dtype"]) for k in kernels} == {
        (k, d) for d, names in KERNELS.items() for k in names
    }
    assert result["problems"] == [] and code == 0, result["problems"]
    assert all(k["loop_spills"] == 0 and k["stack_bytes"] <= 128 for k in kernels if k["dtype"] == "bf16")
    # fewer heads (smaller models: the tiles' other branches) compile within the same limits
    forward_heads = {k["heads"] for k in kernels if k["kernel"] == "fwd_kernel" and k["dtype"] == "bf16"}
    assert forward_heads == {64, 32, 16, 8}
    assert all(k["shared_bytes"] <= 227 * 1024 for k in kernels)


def test_the_dsa_kernels_are_hopper_kernels(compiled):
    """At the released width (64 heads: one warpgroup's 64 rows) the DSA forward and the fused backward use wgmma.
    Before: mma.sync only (16-head tiles; every latent row gathered 4 times). The block-FP8 expert GEMM (forward and
    input gradient) dequantises its tile in registers and multiplies it on wgmma too."""
    _, result = compiled
    mma = {
        k["kernel"]: k["mma"] for k in result["kernels"] if k["dtype"] == "bf16" and k["heads"] in (None, 64)
    }
    assert {k: mma[k] for k in WGMMA} == dict.fromkeys(WGMMA, "wgmma")


def test_no_product_is_computed_twice_but_the_forward_scores(compiled):
    """Triton lays a product that feeds another product with all 8 warps along its rows, so at 64 rows both
    warpgroups compute it whole. The fused backward holds q and dO as one tile of 128 interleaved rows: its score
    product s and dp together has 128 rows, one warpgroup's 64 each, and its latent-gradient product qdo^T [ds; p]
    has the latent's 512 (before: 64 slots as its M). At 32 heads the kernel takes the 64-head tile (padded),
    whose products are not copied either. The forward's scores q c^T feed
    p c and stay computed twice: that is why its slot block is 32 (its wgmma instructions 64 x 16 x 16, not
    64 x 8 x 16 as at 16 slots)."""
    _, result = compiled
    bf16 = [k for k in result["kernels"] if k["dtype"] == "bf16"]
    assert all(k["replicated"] == [] for k in bf16 if k["kernel"].startswith("bwd_query_kernel")), bf16
    forward = next(k for k in bf16 if k["kernel"] == "fwd_kernel" and k["heads"] == 64)
    assert forward["replicated"] == ["[64 x 32] x2"]
    assert set(forward["wgmma_shapes"]) == {"64x16x16", "64x256x16"}


def test_no_kernel_the_model_runs_sums_floats_with_atomics(compiled):
    """Determinism by construction: no kernel of the model's path has a floating-point atomic in its PTX (the
    backward sums each key's slot gradients in one fixed order). The control is the backward's measured
    alternative (`sparse_backward(latent_grad="atomic")`, for benchmarks/dsa_kernel.py): its fused kernel adds into
    d_latent with relaxed fp32 reductions, 16 bytes each (`red...add.v4.f32`), and the check sees them."""
    _, result = compiled
    float_atomics = [(k["kernel"], k["dtype"], k["heads"], r) for k in result["kernels"] for r in k["reductions"]
                     if r.endswith(("f32", "f16", "bf16", "f64"))]  # fmt: skip
    assert [atomic[:3] for atomic in float_atomics] == [("bwd_query_kernel:atomic", "bf16", 64)]
    assert float_atomics[0][3].endswith(".relaxed.add.v4.f32"), (
        float_atomics
    )  # red. (Triton 3.9) or atom. (3.6)


def test_a_spill_would_be_seen_control(compiled):
    """A kernel made to spill inside its loop (a [128, 128] fp32 tile kept whole by one warp across it), compiled
    the same way, shows its stack and the local loads and stores in its loop: the check above would see a spill."""
    _, result = compiled
    control = result["control"]
    assert (
        control["kernel"] == "spilling_kernel" and control["stack_bytes"] > 0 and control["loop_spills"] > 0
    )
