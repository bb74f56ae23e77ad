"""Manifold-constrained hyper-connections (mHC): public API.

`HyperConnection` (hc_pre: collapse + mixing weights), `hc_post` (write back, fused on CUDA), `hc_post_eager`,
`hc_head` (final mean over streams), `expand_streams`, `sinkhorn`.
"""

from .hc_post_op import hc_post, hc_post_eager, hc_post_hf_expression
from .hyper_connection import HyperConnection, expand_streams, hc_head, sinkhorn

__all__ = [
    "HyperConnection",
    "expand_streams",
    "hc_head",
    "hc_post",
    "hc_post_eager",
    "hc_post_hf_expression",
    "sinkhorn",
]
