"""Manifold-constrained hyper-connections (mHC): public API.

`HyperConnection` (hc_pre: collapse + mixing weights), `hc_post` (write back, fused on CUDA), `hc_post_eager`,
`hc_head` (final mean over streams), `expand_streams`, `sinkhorn`, `pack_streams` / `unpack_streams` (the 3-D
form streams take between layers and pipeline stages).
"""

from .hc_post_op import hc_post, hc_post_eager, hc_post_hf_expression
from .hyper_connection import HyperConnection, expand_streams, hc_head, pack_streams, sinkhorn, unpack_streams

__all__ = [
    "HyperConnection",
    "expand_streams",
    "hc_head",
    "hc_post",
    "hc_post_eager",
    "hc_post_hf_expression",
    "pack_streams",
    "sinkhorn",
    "unpack_streams",
]
