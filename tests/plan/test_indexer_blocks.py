"""The planner traces the DSA indexer in the GPU's blocks of query scores (layers/dsa_indexer.py,
`SCORE_BLOCK_BYTES`): meta tensors stand for the GPU's. Before, meta had its own 16 GiB blocks (fewer Python
iterations in the dry run), which the planner measured as memory: a DSA layer's forward peaked at 24.5 GiB at 128k
tokens (SP 16), growing with the square of the length, and LoRA at 128k needed 16 H200 instead of 8. Its own
module: the planner's meta trace joins a fake world."""

from __future__ import annotations

import pytest

from glm53_ds.layers import dsa_indexer
from glm53_ds.plan.activations import plan_activations
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import preset


def _dsa_forward_peaks(lengths: tuple[int, ...]) -> list[int]:
    cfg = preset("tiny")
    peaks = []
    for length in lengths:
        units = plan_activations(
            PlannedRun.for_model(cfg, seq_length=length, micro_batch_size=1, recompute="full")
        ).units
        peaks.append(
            next(u.forward_peak for kind, u in units.items() if kind.startswith("indexed_attention"))
        )
    return peaks


@pytest.mark.parametrize(
    "impl, gpu_block, growth",
    [("torch", 4 * 2**20, (1.0, 4.5)), ("triton", 2**34, (1.0, 4.5)), ("torch", 2**34, (12.0, 17.0))],
    ids=["torch path, the GPU's blocks", "the kernel (GPU default)", "control: torch path, 16 GiB blocks"],
)
def test_the_planners_indexer_blocks_are_the_gpus(monkeypatch, impl, gpu_block, growth):
    """Meta's blocks are the GPU's. The tiny preset at 2,048 and 8,192 tokens: with the torch path
    (`indexer_impl=torch`) and the block set to 4 MiB, the DSA layer's forward peak grows no faster than the length
    (x2.3 for x4 tokens), the indexer holding one block of scores at a time; the control, 16 GiB blocks (the old
    meta value), holds all the scores at once: x15.4, the square of the length. The streaming kernel (what a GPU
    runs by default, `indexer_topk_triton.py`: its fake on meta) holds no scores, so even 16 GiB blocks keep the
    peak linear."""
    blocks = dsa_indexer.SCORE_BLOCK_BYTES
    assert blocks["meta"] == blocks["cuda"]  # meta stands for the GPU
    monkeypatch.setitem(dsa_indexer.SCORE_BLOCK_BYTES, "meta", gpu_block)
    monkeypatch.setenv("GLM53_INDEXER", impl)
    short, long = _dsa_forward_peaks((2048, 8192))
    low, high = growth
    assert low <= long / short <= high, (short, long)
