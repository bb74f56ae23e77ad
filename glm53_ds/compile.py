"""`--compile`: torch.compile applied by region, as torchtitan compiles each transformer block.

The regions: every decoder layer (`Glm53TransformerLayer.forward`), every MTP layer (`Glm53MtpLayer.predict`, its
own transformer layer inside) and the loss head (`linear_cross_entropy`, the chunked output layer + cross entropy).
Layers of one kind share one compiled code: the code object is the class's, and torch.compile (with its default
`inline_inbuilt_nn_modules`) takes the module's parameters as inputs, not as constants; each kind (first layer,
KDA or DSA, dense or MoE, MTP) is one entry of that code's cache, so the cache limit is raised to hold them all.

Graph breaks: none in any region, whole rows and packed documents alike (tests/test_compile.py traces each with
`fullgraph=True`): KDA and MLA with its DSA indexer read a packed row's documents as tensors whose shapes do not
depend on the packing (`Documents.ids` / `positions`), so one graph serves every packing. Only the dense parity
path (`attention_impl=dense | eager`) loops over documents in Python and leaves that loop eager; regions are
therefore compiled with `fullgraph=False`.

Outside the regions (eager): the embedding, the input checks and their one host read, megatron's block loop (and
its full recompute), the stream mean and the final norm, the head's target shifts. Inside, a region runs in a
record of its own (`forward_record.region_record`), so what a layer hands out (balance losses, expert loads) does
not make its guards depend on the layers before it.

Regions are replaced in place (an instance attribute over the method), so parameter names, state dicts and
checkpoints are those of the eager model; `compiled_regions` lists what was compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .layers.forward_record import region_record
from .layers.mtp import Glm53MtpLayer
from .transformer_layer import Glm53TransformerLayer

RECOMPILE_LIMIT = 64
# Static shapes. A training row has one length (--seq-length; packing changes no shape), but the first layer takes
# the embedding [s, b, D] and every other layer the packed streams [s * n, b, D]. Under torch.compile's default
# (`dynamic=None`) the second layer's size, against the first's graph, makes dynamo mark the sequence dim dynamic
# ("automatic dynamic"), and every later layer is traced with symbolic sizes: the fp32 region test's first step took
# 69 s that way, 20 s static (tests/test_compile.py), and inductor generates code for a symbolic length. A row of
# another length compiles anew.
DYNAMIC: bool | None = False
COMPILED = "_glm53_compiled"  # set on a module (or the model, for the loss head) whose region is compiled


Backend = str | Callable[..., Any]


def _compiled(fn: Callable[..., Any], backend: Backend, fullgraph: bool) -> Callable[..., Any]:
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=backend, dynamic=DYNAMIC)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with region_record():
            return compiled(*args, **kwargs)

    return run


def _compile_method(module: nn.Module, method: str, backend: Backend, fullgraph: bool) -> None:
    if getattr(module, COMPILED, False):
        return
    setattr(module, method, _compiled(getattr(module, method), backend, fullgraph))
    setattr(module, COMPILED, True)


def apply_compile(model: nn.Module, backend: Backend = "inductor", fullgraph: bool = False) -> list[str]:
    """Compile `model`'s regions in place (idempotent); returns their names, the loss head as `loss_head`.
    `backend`: torch.compile's, a name or a callable (tests trace with "aot_eager": the same graphs, forward and
    backward, no code generated); shapes static (`DYNAMIC`); `fullgraph=True`: a graph break is an error (whole
    rows only)."""
    # one cache entry per layer kind and input form under one code object (torch's default limit is 8)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    names = []
    # an MTP layer's own transformer layer is compiled inside its `predict`
    inside_mtp = {id(sub) for m in model.modules() if isinstance(m, Glm53MtpLayer) for sub in m.modules()}
    for name, module in model.named_modules():
        if isinstance(module, Glm53MtpLayer):
            _compile_method(module, "predict", backend, fullgraph)
            names.append(name)
        elif isinstance(module, Glm53TransformerLayer) and id(module) not in inside_mtp:
            _compile_method(module, "forward", backend, fullgraph)
            names.append(name)
    if hasattr(model, "loss_head") and not getattr(model, COMPILED, False):
        setattr(model, "loss_head", _compiled(getattr(model, "loss_head"), backend, fullgraph))  # noqa: B009, B010
        setattr(model, COMPILED, True)
        names.append("loss_head")
    return names


def compiled_regions(model: nn.Module) -> list[str]:
    """The names of `model`'s compiled regions (`apply_compile`'s answer), [] for an eager model."""
    names = [name for name, m in model.named_modules() if name and getattr(m, COMPILED, False)]
    return names + (["loss_head"] if getattr(model, COMPILED, False) else [])
