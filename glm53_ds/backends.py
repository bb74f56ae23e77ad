"""Kernel backends, chosen by configuration: one resolver for every kernel choice of the model.

Six fields of `Glm53TransformerConfig` pick how a part of the model is computed:

| field           | values                 | default | what                                                          |
|-----------------|------------------------|---------|---------------------------------------------------------------|
| `attention_impl`| `auto`, `sparse`, `triton`, `dense`, `eager` | `auto` | MLA core: DSA sparse attention (Triton kernel on CUDA, torch reference elsewhere), or the dense masked path (fused SDPA, or HF's eager expression) |
| `kda_impl`      | `auto`, `torch`, `fla` | `auto`  | KDA chunked delta rule: fla-core's kernel on CUDA when installed |
| `hc_post_impl`  | `auto`, `eager`, `triton` | `auto` | mHC write-back: fused Triton kernels on CUDA                |
| `sinkhorn_impl` | `auto`, `torch`, `triton` | `auto` | mHC's Sinkhorn normalisation: one fused Triton kernel forward and one backward on CUDA (`mhc/sinkhorn_triton.py`), the tokens-last torch Function elsewhere |
| `indexer_impl`  | `auto`, `torch`, `triton` | `auto` | DSA indexer's scores and top-k: the streaming Triton kernel on CUDA (`layers/indexer_topk_triton.py`), HF's expression in torch elsewhere; the same choice but at exact ties, which the kernel ranks by ascending pool (`layers/indexer_topk.py`) |
| `moe_impl`      | `auto`, `grouped`, `loop` | `auto` | routed experts: grouped GEMMs over tokens sorted by expert, or the per-expert reference loop (`auto`: grouped when the sizes meet the grouped GEMM's 16-byte alignment) |

Environment variables only supply the defaults, read when a config is built (`GLM53_ATTENTION`, `GLM53_KDA`,
`GLM53_HC_POST`, `GLM53_SINKHORN`, `GLM53_INDEXER`, `GLM53_MOE`); a config's value is then what runs. `auto` is resolved per call from the tensors' device.
"""

from __future__ import annotations

import importlib
import os

import torch

ATTENTION, KDA, HC_POST, SINKHORN, INDEXER, MOE = (
    "attention_impl",
    "kda_impl",
    "hc_post_impl",
    "sinkhorn_impl",
    "indexer_impl",
    "moe_impl",
)
CHOICES = {
    ATTENTION: ("auto", "sparse", "triton", "dense", "eager"),
    KDA: ("auto", "torch", "fla"),
    HC_POST: ("auto", "eager", "triton"),
    SINKHORN: ("auto", "torch", "triton"),
    INDEXER: ("auto", "torch", "triton"),
    MOE: ("auto", "grouped", "loop"),
}
ENV = {
    ATTENTION: "GLM53_ATTENTION", KDA: "GLM53_KDA", HC_POST: "GLM53_HC_POST", SINKHORN: "GLM53_SINKHORN",
    INDEXER: "GLM53_INDEXER", MOE: "GLM53_MOE",
}  # fmt: skip
# former names, still accepted: `sdpa` was the dense path's fused-SDPA backend
ALIASES: dict[str, dict[str, str]] = {
    ATTENTION: {"sdpa": "dense"},
    KDA: {},
    HC_POST: {},
    SINKHORN: {},
    INDEXER: {},
    MOE: {},
}
DEFAULT = {ATTENTION: "auto", KDA: "auto", HC_POST: "auto", SINKHORN: "auto", INDEXER: "auto", MOE: "auto"}


def check(field: str, value: str, source: str | None = None) -> str:
    """`value`, normalised, if it is a valid choice for `field`; else a ValueError naming the field (and source)."""
    normalised = value.strip().lower()
    normalised = ALIASES[field].get(normalised, normalised)
    if normalised not in CHOICES[field]:
        where = f" (from {source})" if source else ""
        raise ValueError(f"{field}={value!r}{where}: expected one of {', '.join(CHOICES[field])}")
    return normalised


def default(field: str) -> str:
    """The default of `field`: its environment variable when set, else the built-in default."""
    env = ENV[field]
    value = os.environ.get(env, "").strip()
    return check(field, value, source=f"{env}={value!r}") if value else DEFAULT[field]


# Both are evaluated eagerly, also inside torch.compile (their results are constants of the graph).
@torch.compiler.assume_constant_result
def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_IMPORTABLE: dict[str, bool] = {}


@torch.compiler.assume_constant_result
def importable(module: str) -> bool:
    if module not in _IMPORTABLE:
        try:
            importlib.import_module(module)
            _IMPORTABLE[module] = True
        except Exception:
            _IMPORTABLE[module] = False
    return _IMPORTABLE[module]


def resolve(field: str, value: str, device: torch.device) -> str:
    """The concrete backend `field = value` means for tensors on `device`; a RuntimeError if it cannot run there.

    Meta tensors (the real-size dry run) stand for the GPU's: `auto` is what a GPU runs, and each kernel's op runs
    there as its fake implementation (what the kernel returns and keeps). KDA on meta is always its operator's
    meta kernel, which is fla's contract (layers/kda_ops.py)."""
    value = check(field, value)
    if device.type == "meta":
        if field == KDA:
            return "torch"
        if field in (ATTENTION, HC_POST, SINKHORN, INDEXER) and value in ("auto", "triton"):
            return "triton"
    cuda = device.type == "cuda"
    if field == KDA:
        if value == "auto":
            return "fla" if cuda and importable("fla.ops.kda") else "torch"
        if value == "fla" and not (importable("fla.ops.kda") and (cuda or triton_interpreter_enabled())):
            raise RuntimeError(
                f"{KDA}='fla' needs the fla-core package (pip install fla-core) and CUDA tensors (or "
                f"TRITON_INTERPRET=1, Triton's CPU interpreter)"
            )
    elif field == ATTENTION:
        if value == "auto":
            return "triton" if cuda and importable("triton") else "sparse"
        if value == "triton" and not (importable("triton") and (cuda or triton_interpreter_enabled())):
            raise RuntimeError(
                f"{ATTENTION}='triton' needs the triton package and CUDA tensors (or TRITON_INTERPRET=1, Triton's "
                f"CPU interpreter); 'sparse' is the same attention in torch"
            )
    elif field in (HC_POST, SINKHORN, INDEXER):
        if value == "auto":
            return "triton" if cuda and importable("triton") else ("eager" if field == HC_POST else "torch")
        if value == "triton":
            if not importable("triton"):
                raise RuntimeError(f"{field}='triton' but the triton package cannot be imported")
            if not cuda and not triton_interpreter_enabled():
                raise RuntimeError(
                    f"{field}='triton' on {device.type} tensors needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
                )
    return value
