"""CUDA correctness checks for the GPU-only paths (run by benchmarks/gpu_check.sh on a lent GPU).

- fused Triton hc_post vs the eager path and an fp64 reference, forward and backward, bf16/fp32, at the real size
  (16k tokens, D=4096, H=4) and at awkward shapes (H=1,3,8; D not a multiple of the block; strided inputs);
- fla-core's KDA kernel vs the torch chunked path (when `fla` is installed), forward and input gradients;
- the MLA core through SDPA vs HF's expression, padding (blind) queries included, with the memory of each;
- the chunked loss head (layers/chunked_ce.py) in bf16 at the released vocabulary and width, the LM's and an MTP
  depth's rows in one call, against the materialised head: its CUDA-only path (bf16 products with fp32 outputs,
  `torch.mm(..., out_dtype=torch.float32)`) and the backward's peak beside the materialised one's.
Tolerances as in tests/mhc/test_hc_post.py; KDA: relative max error <= 2e-2 in bf16, <= 1e-3 in fp32; attention
<= 1e-5 in fp32 (tests/layers/test_mla.py), <= 2e-2 in bf16 (the eager path rounds the scores to bf16).
`--device cpu --small` runs the same checks through Triton's interpreter for a dry run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_hc_post(device: torch.device, small: bool) -> list[dict]:
    from glm53_ds.mhc import hc_post

    rows = []
    shapes = [(64, 4, 4096), (37, 3, 1000), (16, 1, 96), (16, 8, 515)] if small else [
        (16384, 4, 4096), (4096, 3, 1000), (1024, 1, 4096), (2048, 8, 2051)]  # fmt: skip
    for tokens, n, d in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(tokens, d, device=device, generator=g).to(dtype)
            r = torch.randn(tokens, d, n, device=device, generator=g).to(dtype).transpose(-1, -2)  # strided
            p = 2 * torch.rand(tokens, n, device=device, generator=g)
            c = torch.softmax(torch.randn(tokens, n, n, device=device, generator=g), -1)
            grads = {}
            for backend in ("triton", "eager"):
                leaves = [t.clone().requires_grad_(True) for t in (x, r, p, c)]
                out = hc_post(*leaves, backend=backend)
                out.backward(torch.ones_like(out))
                grads[backend] = (out.detach(), [t.grad for t in leaves])
            ref = p.to(dtype).double().unsqueeze(-1) * x.double().unsqueeze(-2) + torch.matmul(
                c.to(dtype).double().transpose(-1, -2), r.double())  # fmt: skip
            (o_t, g_t), (o_e, g_e) = grads["triton"], grads["eager"]
            fwd_ok = torch.equal(o_t, o_e) if dtype != torch.float32 else rel(o_t, o_e) <= 1e-6
            bwd_err = max(rel(a, b) for a, b in zip(g_t, g_e, strict=True))
            rows.append(dict(check="hc_post", shape=f"{tokens}x{n}x{d}", dtype=str(dtype)[6:], fwd_vs_eager_equal=fwd_ok,
                             fwd_vs_fp64=rel(o_t, ref), bwd_vs_eager=bwd_err,
                             ok=fwd_ok and bwd_err <= (1e-2 if dtype != torch.float32 else 1e-5)))  # fmt: skip
    return rows


def check_kda(
    device: torch.device, small: bool, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
) -> list[dict]:
    from glm53_ds.layers import kda_ops

    if not (device.type == "cuda" and kda_ops._fla_available()):
        return [
            dict(check="kda fla vs torch", shape="-", dtype="-", ok=None, note="fla not installed or no CUDA")
        ]
    import time

    from fla.ops.kda import chunk_kda

    rows = []
    b, s, h, d = (1, 256, 2, 64) if small else (1, 4096, 8, 128)
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(b, s, h, d, device=device, generator=g).to(dtype) for _ in range(3))
        gate = (-5 * torch.sigmoid(torch.randn(b, s, h, d, device=device, generator=g))).float()
        beta = torch.sigmoid(torch.randn(b, s, h, device=device, generator=g)).to(dtype)
        outs, first_call = {}, {}
        for name in ("torch", "fla"):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            started = time.perf_counter()
            if name == "torch":
                o = kda_ops.chunk_kda_torch(*leaves, gate, beta)
            else:
                o, _ = chunk_kda(
                    q=leaves[0], k=leaves[1], v=leaves[2], g=gate, beta=beta, use_qk_l2norm_in_kernel=True
                )
            o.float().square().mean().backward()
            torch.cuda.synchronize(device)
            first_call[name] = time.perf_counter() - started  # fla: its autotuning and compilation included
            outs[name] = (o.detach(), [t.grad for t in leaves])
        print(
            f"kda {str(dtype)[6:]}: fla's first fwd+bwd (autotune + compile) {first_call['fla']:.1f} s",
            flush=True,
        )
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
        fwd = rel(outs["fla"][0], outs["torch"][0])
        bwd = max(rel(a, b) for a, b in zip(outs["fla"][1], outs["torch"][1], strict=True))
        rows.append(dict(check="kda fla vs torch", shape=f"{b}x{s}x{h}x{d}", dtype=str(dtype)[6:], fwd=fwd, bwd=bwd,
                         ok=fwd <= tol and bwd <= 5 * tol, fla_first_call_s=first_call["fla"],
                         autotune_configs=os.environ.get("GLM53_FLA_AUTOTUNE_CONFIGS", "all")))  # fmt: skip
    return rows


def check_attention(device: torch.device, small: bool) -> list[dict]:
    """The MLA core's SDPA path vs HF's expression (`attention_impl="eager"`), blind (padding) queries included, and
    the peak memory of each for a forward+backward."""
    from benchmarks.measure import peak_extra_bytes
    from glm53_ds.layers.mla import masked_attention

    b, h, s, d = (1, 2, 96, 64) if small else (1, 8, 4096, 256)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(2)
        q, k, v = (torch.randn(b, h, s, d, device=device, generator=g).to(dtype) for _ in range(3))
        allowed = torch.rand(b, 1, s, s, device=device, generator=g) < 0.3
        allowed[:, :, :8] = False  # blind queries
        results, memory = {}, {}
        for backend in ("eager", "sdpa"):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

            def step(leaves=leaves, allowed=allowed, backend=backend) -> torch.Tensor:
                out = masked_attention(*leaves, allowed, d**-0.5, backend=backend)
                out.float().square().mean().backward()
                return out

            out = step()
            results[backend] = [out.detach()] + [t.grad for t in leaves]
            memory[backend] = peak_extra_bytes(step, [q, k, v, allowed] + leaves) / 2**20
        errs = [rel(a, r) for a, r in zip(results["sdpa"], results["eager"], strict=True)]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        rows.append(dict(check="attention sdpa vs eager", shape=f"{b}x{h}x{s}x{d}", dtype=str(dtype)[6:],
                         fwd=errs[0], bwd=max(errs[1:]), eager_MiB=memory["eager"], sdpa_MiB=memory["sdpa"],
                         ok=max(errs) <= tol))  # fmt: skip
    return rows


def check_loss_head(device: torch.device, small: bool) -> list[dict]:
    from glm53_ds.layers.chunked_ce import linear_cross_entropy

    rows_per_head, hidden, vocab = (40, 64, 1700) if small else (2048, 4096, 154880)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(2 * rows_per_head, hidden, device=device, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden**0.5).bfloat16()
    t = torch.randint(0, vocab, (2 * rows_per_head,), device=device, generator=g)
    t[::7] = -100
    # small: 600-column vocabulary slices over all rows (the slices' path, as at the released size)
    chunk = 2 * rows_per_head * 4 * 600 if small else 256 * 2**20
    results = {}
    for name, chunk_bytes in (("chunked", chunk), ("materialised", 0)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        losses = linear_cross_entropy(hh, ww, t, chunk_bytes=chunk_bytes, groups=2)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        losses.sum().backward()
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
        results[name] = (losses.detach(), hh.grad, ww.grad, peak)
    (loss, dh, dw, peak), (ref_loss, ref_dh, ref_dw, ref_peak) = results["chunked"], results["materialised"]
    errs = dict(loss=rel(loss, ref_loss), d_hidden=rel(dh, ref_dh), d_weight=rel(dw, ref_dw))
    return [dict(check="loss head chunked vs materialised", shape=f"2x{rows_per_head}x{hidden}, V {vocab}",
                 dtype="bfloat16", **errs, backward_peak_gib=peak / 2**30,
                 materialised_backward_peak_gib=ref_peak / 2**30,
                 ok=errs["loss"] <= 1e-4 and errs["d_hidden"] <= 2e-2 and errs["d_weight"] <= 2e-2)]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--checks", nargs="+", default=["hc_post", "kda", "attention", "loss_head"],
                        choices=["hc_post", "kda", "attention", "loss_head"])  # fmt: skip
    parser.add_argument("--kda-dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks.measure import device_description, write_results

    device = torch.device(args.device)
    kda_dtypes = tuple({"bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in args.kda_dtypes)
    checks = {"hc_post": lambda: check_hc_post(device, args.small),
              "kda": lambda: check_kda(device, args.small, kda_dtypes),
              "attention": lambda: check_attention(device, args.small),
              "loss_head": lambda: check_loss_head(device, args.small)}  # fmt: skip
    rows = [row for name in args.checks for row in checks[name]()]
    for r in rows:
        print(r)
    every = sorted(args.checks) == ["attention", "hc_post", "kda", "loss_head"]
    suffix = "" if every else "_" + "_".join(args.checks)
    write_results(
        f"gpu_correctness_{device.type}{suffix}", dict(device=device_description(device), rows=rows)
    )
    failed = [r for r in rows if r.get("ok") is False]
    ran = [r for r in rows if r.get("ok") is not None]
    skipped = f" ({len(rows) - len(ran)} skipped)" if len(ran) < len(rows) else ""
    print(f"gpu_correctness {'FAILED' if failed else 'ok'}: {len(ran) - len(failed)}/{len(ran)}{skipped}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
