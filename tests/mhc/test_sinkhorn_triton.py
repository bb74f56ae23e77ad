"""mHC's Sinkhorn as fused Triton kernels (`sinkhorn_impl=triton`, Triton's interpreter on CPU) against the torch
Function and fp64.

Tolerances (fp32): forward within 1e-6 relative of the Function (the sums' order may differ on a GPU); the forward
and the gradient as close to fp64's as the Function's own, plus 1e-6. Control: the kernels at one iteration fewer
fail the same bounds, so a wrong step count or order in either kernel would be seen.
"""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.mhc import HyperConnection, sinkhorn
from glm53_ds.mhc.hyper_connection import _TokensLastSinkhorn
from tests.mhc.test_hyper_connection import rel_err
from tests.model_fixtures import CONFIG_A

EPS = 1e-6


def _comb(lead: tuple[int, ...], n: int, seed: int, transposed: bool = False) -> torch.Tensor:
    """Positive rows normalised by softmax, + eps (as hc_pre makes them); optionally a non-contiguous view."""
    gen = torch.Generator().manual_seed(seed)
    comb = torch.softmax(torch.randn(*lead, n, n, generator=gen), -1) + EPS
    return comb.transpose(0, 1).contiguous().transpose(0, 1) if transposed else comb


def _value_and_grad(fn, comb: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    comb = comb.detach().requires_grad_()
    out = fn(comb)
    (grad,) = torch.autograd.grad((out * weights.to(out.dtype)).sum(), comb)
    return out.detach(), grad


# (leading shape, n, iters): the released n = 4 with 20 iterations over tokens that leave the last block partial,
# a padded n (3 -> 4 lanes), n = 1 and the largest supported n
@pytest.mark.parametrize("lead, n, iters", [((2, 50), 4, 20), ((7, 11), 3, 5), ((5,), 1, 2), ((3, 9), 8, 4)])
def test_triton_sinkhorn_matches_the_torch_function_and_fp64(lead, n, iters):
    comb = _comb(lead, n, seed=n, transposed=len(lead) == 2)
    weights = torch.randn(comb.shape, generator=torch.Generator().manual_seed(1))
    exact = _value_and_grad(lambda c: _TokensLastSinkhorn.apply(c, iters, EPS), comb.double(), weights)
    torch_fn = _value_and_grad(lambda c: sinkhorn(c, iters, EPS, "torch"), comb, weights)
    fused = _value_and_grad(lambda c: sinkhorn(c, iters, EPS, "triton"), comb, weights)
    assert fused[0].shape == comb.shape and fused[1].shape == comb.shape
    assert rel_err(fused[0], torch_fn[0]) <= 1e-6

    def within_bounds(candidate: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return all(rel_err(ours, exact_value) <= rel_err(ref, exact_value) + 1e-6
                   for ours, ref, exact_value in zip(candidate, torch_fn, exact, strict=True))  # fmt: skip

    assert within_bounds(fused)
    # the control: one iteration fewer (a kernel that skips a step) fails the same bounds (at 20 iterations the
    # forward has converged to 5e-7, its gradient has not: 1.3e-5)
    if iters > 1 and n > 1:
        assert not within_bounds(
            _value_and_grad(lambda c: sinkhorn(c, iters - 1, EPS, "triton"), comb, weights)
        )


def test_the_contract_is_checked_before_any_kernel():
    with pytest.raises(ValueError, match=r"n in 1\.\.8, got \(2, 9, 9\)"):
        sinkhorn(torch.rand(2, 9, 9), 3, EPS, "triton")
    with pytest.raises(TypeError, match="must be fp32"):
        sinkhorn(torch.rand(2, 4, 4, dtype=torch.float64), 3, EPS, "triton")


def test_hyper_connection_and_the_model_run_the_configured_sinkhorn():
    """`sinkhorn_impl` reaches every HyperConnection of a model; its forward and gradients equal the torch path's
    within fp32 rounding (the kernels' op is in the graph: the recorded ops name it)."""
    hc = {impl: HyperConnection(8, 4, EPS, 20, 1e-5, sinkhorn_impl=impl) for impl in ("torch", "triton")}
    hc["triton"].load_state_dict(hc["torch"].state_dict())
    streams = torch.randn(3, 5, 4, 8, generator=torch.Generator().manual_seed(2))
    outs = {}
    for impl, module in hc.items():
        x = streams.clone().requires_grad_()
        collapsed, post, comb = module(x)
        (collapsed.sum() + (comb * torch.arange(16.0).view(4, 4)).sum()).backward()
        outs[impl] = (collapsed, comb, x.grad, module.fn.grad)
    for ours, ref in zip(outs["triton"], outs["torch"], strict=True):
        assert rel_err(ours, ref) <= 1e-5

    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False, sinkhorn_impl="triton")
    assert {m.sinkhorn_impl for m in model.modules() if isinstance(m, HyperConnection)} == {"triton"}
    ids = torch.randint(1, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.profiler.profile() as prof:
        model(ids, labels=ids).backward()
    names = {e.name for e in prof.events()}
    assert {"glm53::sinkhorn_triton", "glm53::sinkhorn_triton_backward"} <= names
