"""HyperConnection (hc_pre) and the whole mHC residual update against transformers' glm5_next.

Tolerances: fp32 forward max relative error <= 1e-6 (relative to the reference's max magnitude), gradients as
close to fp64's as transformers' fp32 ones, within 1e-6;
bf16 streams: `collapsed` within one bf16 ulp of HF, `post`/`comb` (fp32) within 1e-6.
Controls: a bf16 projection, the norm using `hc_eps` or 1e-6, and hc_post without the comb transpose each
fail the same checks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from glm53_ds.mhc import HyperConnection, expand_streams, hc_head, hc_post, hc_post_hf_expression, sinkhorn
from tests.hf_reference import hf_modeling, hf_text_config

RTOL_FP32 = 1e-6

# (hc_mult, sinkhorn_iters, hc_eps, rms_norm_eps)
CASES = [
    (4, 20, 1e-6, 1e-5),  # released values
    (1, 1, 1e-6, 1e-6),
    (3, 5, 1e-4, 1e-5),
    (8, 20, 1e-6, 1e-3),
    (2, 3, 1e-3, 1e-2),
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_pair(hidden, n, iters, hc_eps, norm_eps, seed=0, sinkhorn_impl="auto"):
    """HF module and ours with identical, non-trivial parameters (HF init has base=0, scale=1; perturb both)."""
    hf = hf_modeling.Glm5NextTextHyperConnection(
        hf_text_config(
            hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=hc_eps, rms_norm_eps=norm_eps
        )
    )
    ours = HyperConnection(hidden, n, hc_eps, iters, norm_eps, sinkhorn_impl=sinkhorn_impl)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ours.fn.normal_(0.0, 0.5, generator=g)
        ours.base.normal_(0.0, 1.0, generator=g)
        ours.scale.uniform_(0.5, 2.0, generator=g)
        for name in ("fn", "base", "scale"):
            getattr(hf, name).copy_(getattr(ours, name))
    return hf, ours


def hf_outputs(hf, streams):
    post, comb, collapsed = hf(streams)
    return collapsed, post, comb


def random_streams(shape, scale=1.0, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def forward_backward(module_fn, params, streams, seed=2):
    """Outputs and gradients (streams + params) of a random weighted sum of all three outputs."""
    streams = streams.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    collapsed, post, comb = module_fn(streams)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in (collapsed, post, comb))
    loss.backward()
    return (collapsed, post, comb), [streams.grad] + [p.grad for p in params]


@pytest.mark.parametrize("n, iters, hc_eps, norm_eps", CASES)
@pytest.mark.parametrize("magnitude", [1.0, 1e-3])
# triton: the fused Sinkhorn kernels, in Triton's interpreter
@pytest.mark.parametrize("sinkhorn_impl", ["torch", "triton"])
def test_fp32_forward_and_gradients_match_hf(n, iters, hc_eps, norm_eps, magnitude, sinkhorn_impl):
    hf, ours = make_pair(24, n, iters, hc_eps, norm_eps, sinkhorn_impl=sinkhorn_impl)
    streams = random_streams((2, 5, n, 24), scale=magnitude)
    hf_out, hf_grads = forward_backward(lambda s: hf_outputs(hf, s), [hf.fn, hf.base, hf.scale], streams)
    our_out, our_grads = forward_backward(ours, [ours.fn, ours.base, ours.scale], streams)
    for name, a, b in zip(("collapsed", "post", "comb"), our_out, hf_out, strict=True):
        assert a.dtype == b.dtype
        assert rel_err(a, b) <= RTOL_FP32, name
    # The gradients: as close to fp64's as transformers' own fp32 ones are, within RTOL_FP32. Sinkhorn's backward is
    # written out (hyper_connection._TokensLastSinkhorn), so it rounds unlike autograd; both are up to 4.7e-6 from
    # fp64 here, and 1.1e-6 apart at most (the `scale` gradient, a sum over tokens of terms of both signs).
    hf64 = copy.deepcopy(hf).double()
    _, truth = forward_backward(
        lambda s: hf_outputs(hf64, s), [hf64.fn, hf64.base, hf64.scale], streams.double()
    )
    for name, a, b, t in zip(("streams", "fn", "base", "scale"), our_grads, hf_grads, truth, strict=True):
        assert rel_err(a, t) <= rel_err(b, t) + RTOL_FP32, f"grad {name}: {rel_err(a, t)} vs {rel_err(b, t)}"


@pytest.mark.parametrize("n, iters, hc_eps, norm_eps", CASES[:3])
@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.bfloat16])
def test_bf16_streams_match_hf(n, iters, hc_eps, norm_eps, fn_dtype):
    hf, ours = make_pair(32, n, iters, hc_eps, norm_eps)
    if fn_dtype == torch.bfloat16:
        # As a model loaded in bf16 has it: fn bf16, base/scale fp32 (HF's keep-in-fp32 list).
        hf.fn.data = hf.fn.data.to(torch.bfloat16)
        ours.fn.data = ours.fn.data.to(torch.bfloat16)
    streams = random_streams((3, 7, n, 32), dtype=torch.bfloat16)
    with torch.no_grad():
        c_ref, p_ref, m_ref = hf_outputs(hf, streams)
        c, p, m = ours(streams)
    assert c.dtype == torch.bfloat16 and p.dtype == torch.float32 and m.dtype == torch.float32
    assert ours.base.dtype == torch.float32 and ours.scale.dtype == torch.float32
    assert rel_err(p, p_ref) <= RTOL_FP32 and rel_err(m, m_ref) <= RTOL_FP32
    ulp = torch.finfo(torch.bfloat16).eps * c_ref.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((c.float() - c_ref.float()).abs() <= ulp).all()


def test_fn_in_bf16_gradients_flow_in_its_dtype():
    hf, ours = make_pair(16, 4, 20, 1e-6, 1e-5)
    hf.fn.data = hf.fn.data.to(torch.bfloat16)
    ours.fn.data = ours.fn.data.to(torch.bfloat16)
    streams = random_streams((2, 3, 4, 16))
    _, hf_grads = forward_backward(lambda s: hf_outputs(hf, s), [hf.fn, hf.base, hf.scale], streams)
    _, our_grads = forward_backward(ours, [ours.fn, ours.base, ours.scale], streams)
    assert our_grads[1].dtype == torch.bfloat16
    for a, b in zip(our_grads, hf_grads, strict=True):
        assert torch.equal(a, b) or rel_err(a, b) <= RTOL_FP32


# --------------------------------------------------------------------------- controls: the checks bite
class _BF16Projection(HyperConnection):
    """The known bug: the flattened streams projected in bf16."""

    def mixing_weights(self, streams):
        n = self.hc_mult
        flat = streams.flatten(-2).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(flat.bfloat16(), self.fn.bfloat16()).float()
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s0, s1, s2 = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s0 + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s1 + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s2 + comb_b.view(n, n), dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.sinkhorn_iters, self.hc_eps)


def _parity_error(ours, hf, streams):
    with torch.no_grad():
        return max(rel_err(a, b) for a, b in zip(ours(streams), hf_outputs(hf, streams), strict=True))


def test_control_bf16_projection_fails_parity():
    hf, good = make_pair(32, 4, 20, 1e-6, 1e-5)
    bad = _BF16Projection(32, 4, 1e-6, 20, 1e-5)
    bad.load_state_dict(good.state_dict())
    streams = random_streams((2, 8, 4, 32))
    assert _parity_error(good, hf, streams) <= RTOL_FP32
    assert _parity_error(bad, hf, streams) > 100 * RTOL_FP32


@pytest.mark.parametrize("wrong_eps", ["hc_eps", 1e-6])
def test_control_wrong_norm_eps_fails_parity(wrong_eps):
    hc_eps, norm_eps = 1e-6, 1e-5
    hf, good = make_pair(32, 4, 20, hc_eps, norm_eps)
    bad = HyperConnection(32, 4, hc_eps, 20, hc_eps if wrong_eps == "hc_eps" else wrong_eps)
    bad.load_state_dict(good.state_dict())
    streams = random_streams((2, 8, 4, 32), scale=1e-3)  # small streams: the eps matters
    assert _parity_error(good, hf, streams) <= RTOL_FP32
    assert _parity_error(bad, hf, streams) > 100 * RTOL_FP32


# --------------------------------------------------------------------------- the whole residual update
class _Sublayer(torch.nn.Module):
    """Stand-in for attention/MLP: any function of the collapsed stream exercises the mHC wiring."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states=None, **_):
        return torch.tanh(self.proj(hidden_states))


def _hf_layer_with_stub_blocks(hidden, n):
    """HF's decoder layer (linear-attention + dense MLP) with attention/MLP replaced by stubs and the norms kept:
    its forward is then HF's exact mHC residual update around two sub-blocks."""
    cfg = hf_text_config(hidden_size=hidden, hc_mult=n, num_hidden_layers=1)
    layer = hf_modeling.Glm5NextTextDecoderLayer(cfg, 0)
    layer.self_attn = _Sublayer(hidden)
    layer.mlp = _Sublayer(hidden)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 1.0))
    return cfg, layer


def _our_layer_update(cfg, layer, streams, post_fn=hc_post):
    """Our composition: HyperConnection -> norm -> block -> hc_post, twice, using the HF layer's weights."""
    n, d = cfg.hc_mult, cfg.hidden_size
    for hc_name, norm, block in (
        ("attn_hc", layer.input_layernorm, layer.self_attn),
        ("ffn_hc", layer.post_attention_layernorm, layer.mlp),
    ):
        hc = HyperConnection(d, n, cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
        hc.load_state_dict(getattr(layer, hc_name).state_dict())
        collapsed, post, comb = hc(streams)
        streams = post_fn(block(hidden_states=norm(collapsed)), streams, post, comb)
    return streams


def _no_transpose(x, residual, post, comb):
    return hc_post_hf_expression(x, residual, post, comb.transpose(-1, -2))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_residual_update_matches_hf_decoder_layer(n):
    cfg, layer = _hf_layer_with_stub_blocks(16, n)
    streams = expand_streams(random_streams((2, 5, 16)), n) + 0.1 * random_streams((2, 5, n, 16), seed=4)
    with torch.no_grad():
        ref, _ = layer(streams, attention_mask=torch.ones(2, 5, dtype=torch.bool))
        ours = _our_layer_update(cfg, layer, streams)
    assert rel_err(ours, ref) <= RTOL_FP32
    if n > 1:
        with torch.no_grad():
            wrong = _our_layer_update(cfg, layer, streams, post_fn=_no_transpose)
        assert rel_err(wrong, ref) > 100 * RTOL_FP32


def test_hc_head_and_expand_streams():
    x = random_streams((2, 3, 8))
    s = expand_streams(x, 4)
    assert s.shape == (2, 3, 4, 8) and s.is_contiguous()
    assert torch.equal(hc_head(s), x)
    streams = random_streams((2, 3, 4, 8))
    assert torch.equal(hc_head(streams), hf_modeling.Glm5NextTextHyperHead()(streams))
    with pytest.raises(ValueError, match="hc_mult"):
        expand_streams(x, 0)


def test_bad_stream_shape_is_named():
    hc = HyperConnection(8, 4, 1e-6, 20, 1e-5)
    with pytest.raises(ValueError, match=r"hc_mult=4, hidden=8.*\(2, 3, 8\)"):
        hc(torch.zeros(2, 3, 8))


def _sinkhorn_loop(comb: torch.Tensor, dims: list[int], eps: float) -> torch.Tensor:
    """HF's Sinkhorn as written, through autograd: each normalisation over `dims` in turn."""
    for dim in dims:
        comb = comb / (comb.sum(dim=dim, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("n, iters", [(4, 20), (3, 5), (2, 3)])
def test_the_tokens_last_sinkhorn_is_the_normalisation_loop_forward_and_backward(n, iters):
    """Sinkhorn runs with the tokens last and its backward written out; in fp64 it equals HF's loop through
    autograd, and gradcheck holds."""
    gen = torch.Generator().manual_seed(n)
    comb = torch.softmax(torch.randn(2, 3, n, n, dtype=torch.float64, generator=gen), -1).requires_grad_()
    weights = torch.randn(2, 3, n, n, dtype=torch.float64, generator=gen)
    ours = sinkhorn(comb, iters, 1e-6)
    (grad,) = torch.autograd.grad((ours * weights).sum(), comb)
    columns_first = [-2] + [-1, -2] * (iters - 1)
    loop = _sinkhorn_loop(comb, columns_first, 1e-6)
    (grad_loop,) = torch.autograd.grad((loop * weights).sum(), comb)
    assert rel_err(ours, loop) <= 1e-13 and rel_err(grad, grad_loop) <= 1e-12
    assert torch.autograd.gradcheck(lambda c: sinkhorn(c, iters, 1e-6), (comb,))
    # the control: one normalisation over rows instead of columns differs (after 20 iterations both converge)
    assert rel_err(sinkhorn(comb, 1, 1e-6), _sinkhorn_loop(comb, [-1], 1e-6)) > 1e-3
