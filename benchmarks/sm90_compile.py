"""Every Triton kernel of glm53_ds compiled for an H100 / H200 (sm_90) on a machine without a GPU.

Triton compiles for a target without a device: a stand-in driver reports `GPUTarget("cuda", 90, 32)` and
`JITFunction.run` is made to compile without launching (`warmup`), then the public functions run on CPU tensors of
the real dtypes, shapes and strides at the released width, so every kernel compiles with the specialisation a
launch on the GPU gets (16-divisibility, unit strides, int32 vs int64 indexing). The PTX goes through the ptxas
inside the Triton wheel; `cuobjdump --dump-resource-usage` on the cubin gives registers and the stack (local
memory: spills), `cuobjdump -sass` the machine code. For each kernel: registers per thread, stack bytes, the
local-memory loads and stores inside its loops (a spill there costs every iteration; one outside, a value saved
before the loop and read back after it, costs once per program), shared memory, warps, the occupancy those allow on
an SM (64K registers, 228 KiB shared memory, 2,048 threads), whether its matrix products are Hopper's `wgmma` or
Ampere-style `mma.sync`, and the shapes of its wgmma instructions (M x N x K, with their counts in the code: small N
means the A operand is read from shared memory for few columns).

    python benchmarks/sm90_compile.py            # the table
    python benchmarks/sm90_compile.py --json     # one JSON object (tests/test_sm90_compile.py reads it)
    bash benchmarks/sm90_compile_triton36.sh     # the same under the GPU image's Triton 3.6

Exit status 1 when a bf16 kernel spills inside a loop, saves more than MAX_SAVED_BYTES per thread outside them, or a
kernel needs more than 227 KiB of shared memory (what an sm_90 block can have): the checks the tests assert. Must
run without TRITON_INTERPRET (it is removed here, before any kernel module is imported).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

os.environ.pop("TRITON_INTERPRET", None)  # `triton.jit` reads it when a kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SM90_SHARED = 227 * 1024  # per block (228 KiB per SM, 1 KiB reserved per block)
SM90_SHARED_PER_SM = 228 * 1024
SM90_REGISTERS = 65536
SM90_THREADS = 2048
SM90_BLOCKS = 32
MAX_SAVED_BYTES = 128  # a bf16 kernel's stack outside its loops: at most 32 values saved once per program
# the released width (config.json of GLM-5.3-Flash): 64 heads, kv_lora_rank 512, W = index_topk + index_kpool - 1,
# hidden 4096, hc_mult 4
HEADS, LATENT, SLOTS, HIDDEN, STREAMS = 64, 512, 2063, 4096, 4
INDEXER_HEADS, INDEXER_DIM = 32, 128  # index_n_heads, index_head_dim
# head counts below the released 64 (smaller models: sequence parallelism splits the DSA attention by query and
# keeps all heads, layers/mla.py): the DSA kernels in bf16 again, through the tiles' other branches (32 padded to
# the 64-head tile, 16 and 8 in the 16-head one)
FEWER_HEADS = (32, 16, 8)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _stand_in_driver() -> object:
    """A CUDA driver that only answers what compilation asks: device 0, stream 0, target sm_90."""
    from triton.backends.nvidia.driver import CudaDriver

    class StandIn(CudaDriver):  # type: ignore[misc]
        def __init__(self) -> None:  # no libcuda
            pass

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def is_active(self) -> bool:
            return True

    return StandIn()


@dataclass
class KernelReport:
    kernel: str
    dtype: str
    registers: int
    stack_bytes: int  # local memory per thread: register spills (and any local arrays)
    shared_bytes: int
    warps: int
    occupancy: float  # resident warps / 64 per SM, as registers, shared memory and threads allow
    mma: str  # wgmma | mma.sync | none
    compile_s: float
    loop_spills: int = 0  # local-memory loads / stores (LDL, STL) inside the kernel's loops
    wgmma_shapes: dict[str, int] | None = None  # "64x16x16" -> count of such HGMMA instructions in the code
    # wgmma products every warpgroup computes whole (from the Triton IR: `replicated_products`)
    replicated: list[str] | None = None
    heads: int | None = None  # the DSA kernels' heads per rank (None: not a DSA kernel)
    # the PTX's atomic read-modify-writes, by form ("red.global.gpu.relaxed.add.v4.f32"): a float one makes a
    # kernel's sums depend on the order its programs run in
    reductions: list[str] | None = None

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0


def occupancy(registers: int, shared: int, warps: int) -> float:
    """Resident warps per SM / 64 for one kernel (registers allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // max(1, per_warp * warps)
    by_shared = SM90_SHARED_PER_SM // (shared + 1024) if shared else SM90_BLOCKS
    by_threads = SM90_THREADS // (32 * warps)
    blocks = min(by_registers, by_shared, by_threads, SM90_BLOCKS)
    return blocks * warps * 32 / SM90_THREADS


def _tool(name: str) -> str:
    from triton.backends.nvidia import compiler

    return os.path.join(os.path.dirname(compiler.__file__), "bin", name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of a cubin's one kernel, by cuobjdump."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return int(fields["REG"]), int(fields["STACK"])


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*)")


def sass(cubin: bytes) -> list[tuple[int, str, str]]:
    """The cubin's one kernel as (address, opcode, operands), by cuobjdump -sass."""
    out = _cuobjdump(cubin, "-sass")
    return [
        (int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.match, out.splitlines()) if m
    ]


def loop_spills(code: list[tuple[int, str, str]]) -> int:
    """LDL / STL instructions inside a loop: between a backward branch's target and the branch."""
    loops = []
    for address, opcode, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    return sum(1 for address, opcode, _ in code
               if opcode.startswith(("LDL", "STL")) and any(a <= address <= b for a, b in loops))  # fmt: skip


def wgmma_shapes(code: list[tuple[int, str, str]]) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for _, opcode, _ in code:
        if opcode.startswith("HGMMA."):
            shape = opcode.split(".")[1]
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def replicated_products(ttgir: str) -> list[str]:
    """The kernel's wgmma products whose warps along M cover more rows than the product has, "[M x N] xF": Triton
    lays a product that feeds another product with all warps along M (its rule for attention), so with 8 warps and
    64 rows both warpgroups compute the same [64 x N] (F = 2): twice the tensor-core work and shared-memory reads."""
    layouts = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"^(#mma\d*) = #ttg.nvidia_mma<\{versionMajor = 3.*?warpsPerCTA = \[(\d+), \d+\]", ttgir, re.M)}  # fmt: skip
    out = []
    for m in re.finditer(r"ttng.warp_group_dot .*?-> tensor<(\d+)x(\d+)x\w+, (#mma\d*)>", ttgir):
        rows, cols, layout = int(m.group(1)), int(m.group(2)), m.group(3)
        factor = 16 * layouts.get(layout, 0) // rows
        if factor > 1:
            out.append(f"[{rows} x {cols}] x{factor}")
    return out


def reductions(ptx: str) -> list[str]:
    return sorted(set(re.findall(r"\b((?:red|atom)\.[a-z0-9_.]+)", ptx)))


def _mma(ptx: str) -> str:
    return "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"


class _CompileOnly:
    """`JITFunction.run` compiling without launching; each new compilation recorded with its wall time."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, object, float]] = []
        self._seen: set[int] = set()

    def __enter__(self) -> _CompileOnly:
        self._run = JITFunction.run
        record = self

        def run(fn: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
            started = time.perf_counter()
            kernel = record._run(fn, *args, grid=grid, warmup=True, **kwargs)
            if id(kernel) not in record._seen:
                record._seen.add(id(kernel))
                # a variant by its constexpr
                name = fn.fn.__name__ + (":atomic" if kwargs.get("ATOMIC") else "")
                name += f":K{kwargs['K2']}" if "K2" in kwargs else ""  # the indexer's running top-k width
                name += ":documents" if kwargs.get("DOCUMENTS") else ""  # ... over a packed row's documents
                record.compiled.append((name, kernel, time.perf_counter() - started))
            return kernel

        JITFunction.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        JITFunction.run = self._run  # type: ignore[method-assign]


def _dsa(dtype: torch.dtype, tokens: int, heads: int = HEADS, latent_grad: str = "sorted") -> None:
    """The DSA sparse-attention kernels as the model calls them: q_lat as `absorb_query` makes it (a transposed
    view), the latent [b, L, R], the selection [b, L, W] int32. `latent_grad="atomic"`: the backward's measured
    alternative (`sparse_backward`), whose bf16 kernel reports as `bwd_query_kernel:atomic`."""
    from glm53_ds.layers import sparse_attention_triton as kernels

    g = torch.Generator().manual_seed(0)
    q_lat = torch.randn(1, heads, tokens, LATENT, generator=g).to(dtype).transpose(1, 2)  # [b, L, h, R] view
    latent = torch.randn(1, tokens, LATENT, generator=g).to(dtype)
    selection = torch.randint(0, tokens, (1, tokens, SLOTS), generator=g, dtype=torch.int32)
    out, lse = kernels.sparse_forward(q_lat, latent, selection, LATENT**-0.5)
    grad = torch.randn_like(out)
    kernels.sparse_backward(q_lat, latent, selection, out, lse, grad, LATENT**-0.5, latent_grad=latent_grad)


def _hc_post(dtype: torch.dtype, tokens: int) -> None:
    """hc_post as a decoder layer calls it: the block output and the streams in the activation dtype, the post and
    combination weights in fp32."""
    from glm53_ds.mhc import hc_post_triton as kernels

    x = torch.randn(tokens, HIDDEN).to(dtype)
    residual = torch.randn(tokens, STREAMS, HIDDEN).to(dtype)
    post, comb = torch.rand(tokens, STREAMS), torch.rand(tokens, STREAMS, STREAMS)
    kernels.hc_post_forward(x, residual, post, comb)
    kernels.hc_post_backward(torch.randn_like(residual), x, residual, post, comb)


def _sinkhorn(dtype: torch.dtype, tokens: int) -> None:
    """mHC's Sinkhorn as hc_pre calls it: the mixing weights in fp32 whatever the activation dtype, 20 iterations."""
    from glm53_ds.mhc import sinkhorn_triton as kernels

    comb = torch.softmax(torch.randn(tokens, STREAMS, STREAMS), -1)
    kernels.sinkhorn_forward(comb, 20, 1e-6)
    kernels.sinkhorn_backward(torch.randn_like(comb), comb, 20, 1e-6)


def _block_fp8(dtype: torch.dtype, tokens: int) -> None:
    """The block-FP8 expert GEMM as a LoRA run on the FP8 release calls it: forward (W^T) and input gradient (W) of
    a routed expert's gate_up weight [2I, D] at the released width, 128 x 128 blocks."""
    from glm53_ds.layers import block_fp8_triton as kernels
    from glm53_ds.layers.block_fp8 import BlockLayout, Piece

    experts, inner = 4, 2048
    layout = BlockLayout((Piece(0, inner), Piece(0, inner)), (Piece(0, HIDDEN),), (128, 128))
    rows, cols = layout.tables()
    weight = (torch.zeros(experts, 2 * inner, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(experts, *layout.scale_shape()),
              rows, cols)  # fmt: skip
    offs = torch.tensor([tokens * (e + 1) for e in range(experts)], dtype=torch.int32)
    kernels.grouped_mm(torch.randn(tokens * experts, HIDDEN).to(dtype), *weight, offs, transpose=True)
    kernels.grouped_mm(torch.randn(tokens * experts, 2 * inner).to(dtype), *weight, offs, transpose=False)


def _indexer(dtype: torch.dtype, tokens: int) -> None:
    """The indexer's streaming top-k as `DsaIndexer.select` calls it at the released width: 32 indexer heads of 128,
    q as `wq_b`'s output viewed [b, r, Hi, d], pool keys of a 128k sequence at kpool 16 (8,192 pools), K = 2048 / 16
    = 128 chosen pools; and K = 512 (kpool 4), the widest running top-k; and K = 128 over a packed row of 8k-token
    documents (`visible_to`)."""
    from glm53_ds.layers import indexer_topk_triton as kernel

    g = torch.Generator().manual_seed(0)
    pools = 8192
    q = (
        torch.randn(1, tokens, INDEXER_HEADS * INDEXER_DIM, generator=g)
        .to(dtype)
        .unflatten(-1, (INDEXER_HEADS, -1))
    )
    weights = torch.randn(1, tokens, INDEXER_HEADS, generator=g)
    keys = torch.randn(1, pools, INDEXER_DIM, generator=g).to(dtype)
    visible_from = (torch.arange(pools) * 16 + 15)[None]
    for chosen in (128, 512):
        kernel.indexer_topk(q, weights, keys, visible_from, 0, chosen, INDEXER_DIM**-0.5)
    visible_to = (visible_from // 8192 + 1) * 8192  # each pool's document's end
    kernel.indexer_topk(q, weights, keys, visible_from, 0, 128, INDEXER_DIM**-0.5, visible_to)


CALLERS = {
    "dsa": _dsa,
    "hc_post": _hc_post,
    "sinkhorn": _sinkhorn,
    "block_fp8": _block_fp8,
    "indexer": _indexer,
}
# their tiles follow the heads
_DSA_KERNELS = {
    "_fwd_kernel",
    "_bwd_query_kernel",
    "_bwd_slots_kernel",
    "_bwd_dq_kernel",
    "_bwd_query_kernel:atomic",
}


@triton.jit
def _spilling_kernel(x_ptr, y_ptr, steps, N: tl.constexpr):
    """The control: a [N, N] fp32 tile kept whole by one warp across a loop (the column sums need every value of
    one step before the next): N * N / 32 values per thread, past the 255 registers a thread may have."""
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs[:, None] * N + offs[None, :])
    for _ in range(steps):
        x = x * tl.sum(x, 0)[None, :] + tl.sum(x, 1)[:, None]
    tl.store(y_ptr + offs[:, None] * N + offs[None, :], x)


def _report(name: str, dtype: str, kernel: object, seconds: float) -> KernelReport:
    cubin = kernel.asm["cubin"]  # type: ignore[attr-defined]
    registers, stack = resource_usage(cubin)
    shared, warps = kernel.metadata.shared, kernel.metadata.num_warps  # type: ignore[attr-defined]
    code = sass(cubin)
    return KernelReport(name.lstrip("_"), dtype, registers, stack, shared, warps, occupancy(registers, shared, warps),
                        _mma(kernel.asm["ptx"]), round(seconds, 2), loop_spills(code), wgmma_shapes(code),
                        replicated_products(kernel.asm["ttgir"]), None,
                        reductions(kernel.asm["ptx"]))  # type: ignore[attr-defined]  # fmt: skip


def control() -> KernelReport:
    """A kernel that must spill inside its loop, compiled the same way: the check sees a spill when there is one."""
    driver.set_active(_stand_in_driver())
    with _CompileOnly() as compiled:
        x = torch.zeros(128, 128)
        _spilling_kernel[(1,)](x, x, 4, N=128, num_warps=1)
    name, kernel, seconds = compiled.compiled[0]
    return _report(name, "fp32", kernel, seconds)


def compile_all(dtypes: tuple[str, ...] = ("bf16", "fp32"), tokens: int = 256) -> list[KernelReport]:
    """Every kernel of every caller, per dtype, compiled for sm_90; the reports in compilation order."""
    driver.set_active(_stand_in_driver())  # for the rest of the process: without a GPU there is no other
    reports: list[KernelReport] = []
    runs = [(dtype, CALLERS.values(), HEADS) for dtype in dtypes]
    runs += [("bf16", [functools.partial(_dsa, heads=h)], h) for h in FEWER_HEADS if "bf16" in dtypes]
    # the atomic latent gradient: its fused backward kernel (the forward is the sorted path's, again)
    if "bf16" in dtypes:
        runs.append(("bf16", [functools.partial(_dsa, latent_grad="atomic")], HEADS))
    for dtype, calls, heads in runs:
        with _CompileOnly() as compiled:
            for call in calls:
                call(DTYPES[dtype], tokens)
        for name, kernel, seconds in compiled.compiled:
            if heads != HEADS and name not in _DSA_KERNELS:
                continue
            report = _report(name, dtype, kernel, seconds)
            report.heads = heads if name in _DSA_KERNELS else None
            same = [r for r in reports if (r.kernel, r.dtype) == (report.kernel, report.dtype)]
            if not any(asdict(r) | {"compile_s": 0} == asdict(report) | {"compile_s": 0} for r in same):
                reports.append(report)  # another specialisation (an argument's divisibility) that differs
    return reports


def problems(reports: list[KernelReport]) -> list[str]:
    out = [f"{r.kernel} ({r.dtype}) spills inside a loop: {r.loop_spills} local loads / stores" for r in reports
           if r.loop_spills and r.dtype == "bf16"]  # fmt: skip
    out += [f"{r.kernel} ({r.dtype}) saves {r.stack_bytes} bytes per thread outside its loops, more than "
            f"{MAX_SAVED_BYTES}" for r in reports if r.stack_bytes > MAX_SAVED_BYTES and r.dtype == "bf16"]  # fmt: skip
    out += [f"{r.kernel} ({r.dtype}) needs {r.shared_bytes / 1024:.0f} KiB of shared memory, more than 227 KiB"
            for r in reports if r.shared_bytes > SM90_SHARED]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    p.add_argument(
        "--tokens", type=int, default=256, help="query rows of the compile-only calls (default: 256)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--control", action="store_true", help="also a kernel that must spill (reported apart)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    reports = compile_all(tuple(args.dtypes), args.tokens)
    found = problems(reports)
    checked = control() if args.control else None
    head = {"triton": triton.__version__, "torch": torch.__version__, "target": "sm_90",
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    lines = [f"Triton {head['triton']}, torch {head['torch']}: every kernel compiled for sm_90 at the released "
             f"width (64 heads, latent 512, W {SLOTS}, hidden {HIDDEN}; the DSA kernels in bf16 also at "
             f"{', '.join(map(str, FEWER_HEADS))} heads) in {head['seconds']} s",
             f"{'kernel':<36}{'dtype':<6}{'regs':>5}{'stack':>7}{'in loops':>9}{'smem KiB':>10}{'warps':>6}"
             f"{'occupancy':>10}  mma (wgmma shapes: count)"]  # fmt: skip
    lines += [f"{r.kernel + (f' ({r.heads}h)' if r.heads and r.heads != HEADS else ''):<36}{r.dtype:<6}{r.registers:>5}{r.stack_bytes:>7}{r.loop_spills:>9}"
              f"{r.shared_bytes / 1024:>10.1f}{r.warps:>6}{r.occupancy:>10.0%}  {r.mma}"
              + (" (" + ", ".join(f"{k}: {v}" for k, v in (r.wgmma_shapes or {}).items()) + ")" if r.wgmma_shapes else "")
              + (f"; on every warpgroup: {', '.join(r.replicated)}" if r.replicated else "")
              + (f"; atomics: {', '.join(r.reductions)}" if r.reductions else "")
              for r in reports]  # fmt: skip
    lines += [f"problem: {problem}" for problem in found]
    if args.json:
        print(json.dumps({**head, "kernels": [dict(asdict(r), spills=r.spills) for r in reports],
                          "problems": found, "table": lines,
                          "control": None if checked is None else dict(asdict(checked), spills=checked.spills)}))  # fmt: skip
    else:
        print("\n".join(lines))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
