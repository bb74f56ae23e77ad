"""hc_post: eager path vs HF's expression, fused Triton kernels (interpreter on CPU) vs eager and fp64.

Tolerances:
  - eager vs HF expression: fp32 <= 1e-6 relative (to the max magnitude), bf16/fp16 within one ulp elementwise;
  - Triton vs eager, forward: bitwise equal in bf16/fp16 (same rounding sequence), fp32 <= 1e-6 relative;
  - Triton vs eager, backward: fp32 gradients (incl. post/comb of bf16 activations) <= 1e-6 relative,
    bf16/fp16 gradients within one ulp of the larger magnitude;
  - both vs an fp64 reference of the same contract (post/comb rounded to the activation dtype first):
    fp32 forward <= 1e-6, gradients <= 1e-5 relative; bf16/fp16 forward within 3 units of roundoff of the
    terms' magnitudes, gradients <= 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from glm53_ds import backends
from glm53_ds.mhc import hc_post, hc_post_eager, hc_post_hf_expression

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading shape, hc_mult, hidden): D not a multiple of the block, and D spanning several blocks
SHAPES = [((2, 3), 4, 37), ((5,), 1, 16), ((1, 2), 3, 100), ((3,), 8, 515), ((2, 2), 4, 1030)]


def make_inputs(lead, n, d, dtype, seed=0, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g).to(dtype)
    res = torch.randn(*lead, n, d, generator=g).to(dtype)
    post = 2 * torch.rand(*lead, n, generator=g)
    comb = torch.softmax(torch.randn(*lead, n, n, generator=g), dim=-1)
    if layout == "transposed":
        # same values, non-contiguous: the hidden dim is not innermost, streams are strided
        res = res.transpose(-1, -2).contiguous().transpose(-1, -2)
        comb = comb.transpose(-1, -2).contiguous().transpose(-1, -2)
        x = torch.stack([x, x], dim=-1)[..., 0]
    elif layout == "sliced":
        res = torch.cat([res, res], dim=-1)[..., :d]
        post = torch.cat([post, post], dim=-1)[..., :n]
    return x, res, post, comb


def reference_fp64(x, res, post, comb):
    """The contract in fp64: post/comb rounded to the activation dtype, then exact arithmetic."""
    dtype = res.dtype
    p, c = post.to(dtype).double(), comb.to(dtype).double()
    return p.unsqueeze(-1) * x.double().unsqueeze(-2) + torch.matmul(c.transpose(-1, -2), res.double())


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def within_ulps(a, b, dtype, ulps=1.0):
    """Elementwise |a - b| <= ulps * eps(dtype) * max(|a|, |b|) (plus the smallest normal)."""
    a, b = a.double(), b.double()
    info = torch.finfo(dtype)
    return bool(((a - b).abs() <= ulps * info.eps * torch.maximum(a.abs(), b.abs()) + info.tiny).all())


def run_with_grads(fn, inputs, grad_seed=7):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves], g


# --------------------------------------------------------------------------- eager vs HF
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, n, d", SHAPES)
def test_eager_matches_hf_expression(lead, n, d, dtype):
    inputs = make_inputs(lead, n, d, dtype)
    ours = hc_post_eager(*inputs)
    ref = hc_post_hf_expression(*inputs)
    assert ours.dtype == dtype and ours.shape == ref.shape
    if dtype == torch.float32:
        assert rel(ours, ref) <= 1e-6
    else:
        assert within_ulps(ours, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_gradients_match_fp64(dtype):
    inputs = make_inputs((3, 4), 4, 33, dtype)
    _, grads, g = run_with_grads(hc_post_eager, inputs)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in inputs]
    reference_fp64(*ref_inputs).backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, ref_t, inp in zip(("x", "residual", "post", "comb"), grads, ref_inputs, inputs, strict=True):
        assert a.dtype == inp.dtype, name
        assert rel(a, ref_t.grad) <= tol, f"{name}: {rel(a, ref_t.grad)}"


# --------------------------------------------------------------------------- Triton vs eager vs fp64
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, n, d", SHAPES)
def test_triton_forward_backward(lead, n, d, dtype):
    inputs = make_inputs(lead, n, d, dtype, seed=n + d)
    out_t, grads_t, g = run_with_grads(lambda *a: hc_post(*a, backend="triton"), inputs)
    out_e, grads_e, _ = run_with_grads(hc_post_eager, inputs)

    # forward: identical rounding sequence
    if dtype == torch.float32:
        assert rel(out_t, out_e) <= 1e-6
    else:
        assert torch.equal(out_t, out_e)
    # forward vs fp64: roundoff of the two terms' magnitudes
    x, res, post, comb = inputs
    ref = reference_fp64(*inputs)
    p, c = post.to(dtype).double(), comb.to(dtype).double()
    scale = p.abs().unsqueeze(-1) * x.double().abs().unsqueeze(-2) + torch.matmul(
        c.abs().transpose(-1, -2), res.double().abs()
    )
    if dtype == torch.float32:
        assert rel(out_t, ref) <= 1e-6
    else:
        assert bool(((out_t.double() - ref).abs() <= 3 * torch.finfo(dtype).eps * scale + 1e-30).all())

    # backward
    ref_inputs = [t.detach().double().requires_grad_(True) for t in inputs]
    reference_fp64(*ref_inputs).backward(g.double())
    for name, a, b, ref_t, inp in zip(
        ("x", "residual", "post", "comb"), grads_t, grads_e, ref_inputs, inputs, strict=True
    ):
        assert a.dtype == inp.dtype and a.shape == inp.shape, name
        if inp.dtype == torch.float32:  # fp32 accumulations over D in different orders
            assert rel(a, b) <= 1e-6, f"{name} triton vs eager: {rel(a, b)}"
        else:
            assert within_ulps(a, b, dtype), name
        assert rel(a, ref_t.grad) <= (1e-5 if dtype == torch.float32 else 1e-2), name


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_non_contiguous_inputs(layout, backend):
    dense = make_inputs((2, 3), 4, 40, torch.bfloat16)
    strided = make_inputs((2, 3), 4, 40, torch.bfloat16, layout=layout)
    assert not all(t.is_contiguous() for t in strided)
    for a, b in zip(dense, strided, strict=True):
        assert torch.equal(a, b)
    out_d, grads_d, _ = run_with_grads(lambda *a: hc_post(*a, backend=backend), dense)
    out_s, grads_s, _ = run_with_grads(lambda *a: hc_post(*a, backend=backend), strided)
    assert torch.equal(out_d, out_s)
    for a, b in zip(grads_d, grads_s, strict=True):
        # the kernels read strided memory directly: bitwise; torch matmuls may block differently per layout
        assert torch.equal(a, b) if backend == "triton" else rel(a, b) <= 1e-6


def test_empty_token_batch():
    for backend in ("triton", "eager"):
        inputs = make_inputs((0,), 4, 16, torch.float32)
        out, grads, _ = run_with_grads(lambda *a, b=backend: hc_post(*a, backend=b), inputs)
        assert out.shape == (0, 4, 16) and all(g.numel() == 0 for g in grads)


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    inputs = make_inputs((2, 5), 4, 24, torch.float32)

    def step(x, res, post, comb):
        return hc_post(x * 2, res, post, comb, backend=backend).square().sum()

    compiled = torch.compile(step, fullgraph=True)
    leaves_c = [t.clone().requires_grad_(True) for t in inputs]
    leaves_e = [t.clone().requires_grad_(True) for t in inputs]
    loss_c = compiled(*leaves_c)
    loss_e = step(*leaves_e)
    loss_c.backward()
    loss_e.backward()
    assert rel(loss_c.detach(), loss_e.detach()) <= 1e-6
    for a, b in zip(leaves_c, leaves_e, strict=True):
        assert rel(a.grad, b.grad) <= 1e-6


# --------------------------------------------------------------------------- dispatch and input checks
def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("GLM53_HC_POST", raising=False)
    assert (
        backends.resolve(backends.HC_POST, backends.default(backends.HC_POST), cpu) == "eager"
    )  # CPU default
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.resolve(backends.HC_POST, "triton", cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backends.resolve(backends.HC_POST, "triton", cpu)
    assert backends.resolve(backends.HC_POST, "eager", cpu) == "eager"
    with pytest.raises(ValueError, match="hc_post_impl='cuda': expected one of auto, eager, triton"):
        backends.resolve(backends.HC_POST, "cuda", cpu)
    monkeypatch.setenv("GLM53_HC_POST", "cuda")  # the environment supplies defaults only, checked when read
    with pytest.raises(ValueError, match="hc_post_impl='cuda' \\(from GLM53_HC_POST='cuda'\\)"):
        backends.default(backends.HC_POST)


def test_config_field_picks_the_path(monkeypatch):
    """The transformer config's hc_post_impl decides (the environment only its default), and a layer runs it."""
    import glm53_ds
    import glm53_ds.mhc.hc_post_triton as kernels
    from glm53_ds.config import Glm53Config
    from tests.model_fixtures import CONFIG_A

    calls = []
    real = kernels.hc_post_forward
    monkeypatch.setattr(kernels, "hc_post_forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    ids = torch.randint(1, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("GLM53_HC_POST", "triton")  # a default: read when the config is built
    model = glm53_ds.build_model(cfg, mtp=False)
    assert model.config.hc_post_impl == "triton"
    monkeypatch.setenv("GLM53_HC_POST", "eager")  # too late for that model: its config decides
    with torch.no_grad():
        model(ids)
    assert calls, "the triton kernels did not run"
    calls.clear()
    with torch.no_grad():
        glm53_ds.build_model(cfg, mtp=False, hc_post_impl="eager")(ids)
    assert not calls


def test_env_forces_path(monkeypatch):
    inputs = make_inputs((2,), 4, 8, torch.float32)
    calls = []
    import glm53_ds.mhc.hc_post_triton as kernels

    real = kernels.hc_post_forward
    monkeypatch.setattr(kernels, "hc_post_forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("GLM53_HC_POST", "triton")  # hc_post(backend=None) takes the default
    hc_post(*inputs)
    assert calls == [1]
    monkeypatch.setenv("GLM53_HC_POST", "eager")
    hc_post(*inputs)
    assert calls == [1]
    hc_post(*inputs, backend="triton")  # an explicit backend wins
    assert calls == [1, 1]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x, r, p, c: (x[..., :-1], r, p, c), r"x has shape \(2, 3, 7\), expected \(2, 3, 8\)"),
        (lambda x, r, p, c: (x, r, p[..., :2], c), r"post has shape"),
        (lambda x, r, p, c: (x, r, p, c[..., :2]), r"comb has shape"),
        (lambda x, r, p, c: (x.double(), r, p, c), r"share the activation dtype"),
        (lambda x, r, p, c: (x, r, p.long(), c), r"post must be a floating-point"),
    ],
)
def test_bad_inputs_are_named(mutate, message):
    inputs = mutate(*make_inputs((2, 3), 4, 8, torch.float32))
    with pytest.raises((ValueError, TypeError), match=message):
        hc_post(*inputs)


def test_triton_rejects_too_many_streams():
    with pytest.raises(ValueError, match="hc_mult 1..8"):
        hc_post(*make_inputs((2,), 9, 8, torch.float32), backend="triton")


# --------------------------------------------------------------------------- eager chunking and memory
def test_eager_chunks_give_the_same_result(monkeypatch):
    import glm53_ds.mhc.hc_post_op as hc_post_module

    inputs = make_inputs((3, 7), 4, 24, torch.bfloat16)
    whole, grads_whole, _ = run_with_grads(hc_post_eager, inputs)
    monkeypatch.setattr(hc_post_module, "EAGER_CHUNK_ELEMENTS", 4 * 24 * 2)  # 2 tokens per chunk, 11 chunks
    chunked, grads_chunked, _ = run_with_grads(hc_post_eager, inputs)
    assert torch.equal(whole, chunked)
    for a, b in zip(grads_whole, grads_chunked, strict=True):
        assert rel(a, b) <= 1e-6


def test_eager_forward_memory_is_bounded():
    """Peak extra memory of the eager forward: the output plus one chunk's temporaries, below HF's expression
    (which holds two full-size intermediates) and far below an [..., H, H, D] intermediate."""
    from benchmarks.measure import peak_extra_bytes
    from glm53_ds.mhc.hc_post_op import EAGER_CHUNK_ELEMENTS, hc_post_forward_eager

    tokens, n, d = 8192, 4, 512
    inputs = make_inputs((tokens,), n, d, torch.bfloat16)
    out_bytes = tokens * n * d * 2
    with torch.no_grad():
        eager = peak_extra_bytes(lambda: hc_post_forward_eager(*inputs), list(inputs))
        hf = peak_extra_bytes(lambda: hc_post_hf_expression(*inputs), list(inputs))
    chunk_temps = 6 * EAGER_CHUNK_ELEMENTS * 4  # a handful of fp32 [chunk, n, D] tensors
    assert eager <= out_bytes + chunk_temps
    assert hf >= 2 * out_bytes  # the measurement sees HF's intermediates (control for the tracker)
    assert eager < hf
