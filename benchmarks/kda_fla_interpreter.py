"""fla-core's KDA kernel vs glm53_ds's torch path on CPU, through Triton's interpreter (no GPU needed).

`kda_attention` hands KDA to fla-core's `chunk_kda` on CUDA. Without a GPU this script checks that call's contract
(per-step log-space gate, l2-normalised q/k in the kernel, default 1/sqrt(dk) scale, output layout) against
`chunk_kda_torch`, forward and the gradients of q, k, v, g and beta, in fp32.

Triton's interpreter cannot run two things fla uses, so the script works on a temporary copy of the package:
  - `.to(tl.int64)` on a Python `for ... in range(...)` index (an int under the interpreter) becomes
    `tl.full([], i, tl.int64)`, the same value;
  - the autotuner's timing needs a GPU driver, so every candidate config is given the same time (the first wins).
bf16 is not checked here: the interpreter's numpy emulation of fla's bf16 dots overflows; gpu_correctness.py covers
bf16 on a GPU.

    pip install --no-deps --target /tmp/fla fla-core==0.6.0
    python3 benchmarks/kda_fla_interpreter.py --fla-path /tmp/fla

Last line: `kda_fla_interpreter ok: n/n max_fwd=<rel> max_grad=<rel>`; JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import print_table, write_results  # noqa: E402
from glm53_ds.layers.documents import Documents  # noqa: E402
from glm53_ds.layers.kda_ops import chunk_kda_torch, kda_attention  # noqa: E402

FWD_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32, relative to the largest reference magnitude
CASES = [
    (2, 130, 2, 64),
    (1, 80, 2, 32),
]  # b, s, h, d: sequences that are not a multiple of the 64-token chunk


def _interpretable_copy(fla_parent: str, into: str) -> str:
    """Copy `fla_parent/fla` to `into/fla`, rewriting loop-index casts the interpreter cannot evaluate."""
    shutil.copytree(os.path.join(fla_parent, "fla"), os.path.join(into, "fla"))
    rewritten = 0
    for folder, _, files in os.walk(os.path.join(into, "fla")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for index in set(re.findall(r"for (\w+) in range\(", text)):
                text, n = re.subn(rf"\b{index}\.to\(tl\.int64\)", f"tl.full([], {index}, tl.int64)", text)
                rewritten += n
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    print(f"fla copied to {into}; {rewritten} loop-index casts rewritten")
    return into


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _packed_documents_rows() -> list[dict]:
    """glm53_ds's varlen call (kda_attention with documents -> chunk_kda(cu_seqlens=...)) vs the torch reference
    run once per document, forward and gradients; control: the same row without boundaries differs."""
    cuts = [0, 37, 38, 101, 150]  # a 1-token document, documents across the 64-token chunk edges
    documents = Documents.from_cu_seqlens(torch.tensor(cuts), cuts[-1])
    g = torch.Generator().manual_seed(5)
    h, d = 2, 32
    q, k, v = (torch.randn(1, cuts[-1], h, d, generator=g) for _ in range(3))
    gate = -5 * torch.sigmoid(torch.randn(1, cuts[-1], h, d, generator=g))
    beta = torch.sigmoid(torch.randn(1, cuts[-1], h, generator=g))
    results = {}
    for backend in ("torch", "fla"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate, beta)]
        if backend == "torch":  # the reference: each document alone
            out = torch.cat(
                [chunk_kda_torch(*(t[:, a:e] for t in leaves)) for a, e in documents.bounds], dim=1
            )
        else:
            out = kda_attention(*leaves, backend=backend, documents=documents)
        out.square().mean().backward()
        results[backend] = (out.detach(), [t.grad for t in leaves])
    fwd = _rel(results["fla"][0], results["torch"][0])
    grads = {n: _rel(a, r) for n, a, r in zip("qkvgb", results["fla"][1], results["torch"][1], strict=True)}
    with torch.no_grad():
        leaked = _rel(kda_attention(q, k, v, gate, beta, backend="fla"), results["torch"][0])
    return [
        dict(shape=f"packed {cuts}", fwd=fwd, **{f"d{n}": e for n, e in grads.items()},
             ok=fwd <= FWD_TOL and max(grads.values()) <= GRAD_TOL),
        dict(shape="control packed, no cu_seqlens", fwd=leaked, ok=leaked > FWD_TOL),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fla-path", help="folder holding the `fla` package (default: the installed one)")
    args = parser.parse_args()
    parent = args.fla_path
    if parent is None:
        spec = importlib.util.find_spec("fla")
        if spec is None or spec.origin is None:
            print("fla is not installed; pass --fla-path (pip install --no-deps --target DIR fla-core)")
            return 2
        parent = os.path.dirname(os.path.dirname(spec.origin))

    from triton.runtime.autotuner import Autotuner

    Autotuner._bench = lambda self, *a, config, **kw: [1.0, 1.0, 1.0]  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, _interpretable_copy(parent, tmp))
        import fla
        from fla.ops.kda import chunk_kda

        rows = []
        for b, s, h, d in CASES:
            g = torch.Generator().manual_seed(s)
            q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
            gate = -5 * torch.sigmoid(
                torch.randn(b, s, h, d, generator=g)
            )  # per-step log decay, as the layer gives
            beta = torch.sigmoid(torch.randn(b, s, h, generator=g))
            results = {}
            for backend in ("torch", "fla"):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate, beta)]
                if backend == "torch":
                    out = chunk_kda_torch(*leaves)
                else:
                    out, _ = chunk_kda(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4],
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
                out.square().mean().backward()
                results[backend] = (out.detach(), [t.grad for t in leaves])
            fwd = _rel(results["fla"][0], results["torch"][0])
            grads = {
                n: _rel(a, r) for n, a, r in zip("qkvgb", results["fla"][1], results["torch"][1], strict=True)
            }
            rows.append(dict(shape=f"{b}x{s}x{h}x{d}", fwd=fwd, **{f"d{n}": e for n, e in grads.items()},
                             ok=fwd <= FWD_TOL and max(grads.values()) <= GRAD_TOL))  # fmt: skip
        # control: the same comparison must fail when the contract is broken (q, k not normalised in the kernel)
        with torch.no_grad():
            broken, _ = chunk_kda(q=q, k=k, v=v, g=gate, beta=beta, use_qk_l2norm_in_kernel=False)
        control = _rel(broken, chunk_kda_torch(q, k, v, gate, beta))
        rows.append(dict(shape=f"control {b}x{s}x{h}x{d}, no l2norm", fwd=control, ok=control > FWD_TOL))
        rows += _packed_documents_rows()
        version = getattr(fla, "__version__", "?")
    print_table(rows, ["shape", "fwd", "dq", "dk", "dv", "dg", "db", "ok"])
    write_results("kda_fla_interpreter_cpu", dict(fla_version=version, tolerances=dict(fwd=FWD_TOL, grad=GRAD_TOL),
                                                  rows=rows))  # fmt: skip
    passed = sum(r["ok"] for r in rows)
    checks = [r for r in rows if "dq" in r]
    max_grad = max(r[f"d{n}"] for r in checks for n in "qkvgb")
    print(f"kda_fla_interpreter {'ok' if passed == len(rows) else 'FAILED'}: {passed}/{len(rows)} "
          f"max_fwd={max(r['fwd'] for r in checks):.2e} max_grad={max_grad:.2e} control_fwd={control:.2e}")  # fmt: skip
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
