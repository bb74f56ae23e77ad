"""--base-quant fp8: frozen weights resident in the release's block-FP8, dequantised tile by tile inside the GEMMs.

The model keeping them so computes the dequantised model's values, bit for bit (losses and every gradient, fp32 and
bf16, grouped and loop experts, with and without adapters); each expert shard holds the right blocks (partial edge
blocks, an ETP slice starting inside a block), with a control showing a wrong block index is caught; autograd keeps
no dequantised weight; the loader refuses what it cannot prove."""

from __future__ import annotations

import json

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.convert.fp8 import Fp8FormatError
from glm53_ds.hf_loader import CheckpointError, SafetensorsCheckpoint, block_fp8_kinds, load_hf_state_into
from glm53_ds.layers import block_fp8
from glm53_ds.layers.block_fp8 import KINDS, dense_weight
from glm53_ds.layers.lora import LoraSpec
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.layers.moe import GroupedExperts
from glm53_ds.parallel.expert_shard import ExpertShard
from glm53_ds.training.config import recompute_overrides
from glm53_ds.transformer_config import make_transformer_config
from tests.model_fixtures import CONFIG_A, add_mtp_tensors, save_fp8_copy, save_tiny_hf

# CONFIG_A: hidden 32, expert intermediate 16, dense intermediate 48. 12 x 10 blocks: every weight has partial edge
# blocks, and ETP rank 1's rows of an expert (8..15) start inside block 0 and end inside block 1.
BLOCK = (12, 10)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    save_tiny_hf(root / "bf16", CONFIG_A)
    add_mtp_tensors(root / "bf16", seed=9)
    return root, save_fp8_copy(root / "bf16", root / "fp8", BLOCK)


def _loss_and_grads(path, base_quant: str, dtype, moe_impl: str, lora: bool, **overrides):
    model = glm53_ds.load_hf(str(path), dtype=dtype, base_quant=base_quant, moe_impl=moe_impl, **overrides)
    if lora:
        for p in model.parameters():
            p.requires_grad_(False)
        apply_lora(model, LoraSpec(rank=8, alpha=16))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora." in name:  # B too: the adapters change the output, their gradients all nonzero
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    else:  # the base trains but for the weights kept in FP8 (frozen in the other model as well)
        for name, p in model.named_parameters():
            p.requires_grad_(not any(k in name for k in ("mlp.experts.", "linear_fc")))
    ids = torch.randint(1, 90, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids)
    loss = (loss if torch.is_tensor(loss) else loss[0]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


# full recompute with the layers' inputs offloaded to host memory and the MoE in tiles of 2 KiB (several per layer)
OFFLOADED_TILES = dict(recompute_overrides("full"), offload_activations=True, moe_tile_bytes=2048)


@pytest.mark.parametrize("dtype, moe_impl, lora, overrides", [
    (torch.float32, "grouped", True, {}), (torch.bfloat16, "grouped", True, {}), (torch.bfloat16, "loop", True, {}),
    (torch.float32, "grouped", False, {}), (torch.bfloat16, "grouped", True, OFFLOADED_TILES),
], ids=["fp32", "bf16", "bf16-loop", "fp32-base-trains", "bf16-recompute-offload-tiles"])  # fmt: skip
def test_the_fp8_base_computes_the_dequantised_models_values_bitwise(
    checkpoints, dtype, moe_impl, lora, overrides
):
    _, fp8 = checkpoints
    loss, grads, model = _loss_and_grads(fp8, "fp8", dtype, moe_impl, lora, **overrides)
    want_loss, want_grads, dense = _loss_and_grads(fp8, "none", dtype, moe_impl, lora, **overrides)
    held = [n for n, b in model.named_buffers() if b.dtype == torch.float8_e4m3fn]
    assert (
        len(held) == 4 * 5 + 2 * 2
    )  # 2 expert + 2 shared tensors in 4 MoE layers and MTP, 2 in 2 dense MLPs
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and len(grads) > 20
    assert [n for n in grads if not torch.equal(grads[n], want_grads[n])] == []
    # the dense model's weights are the FP8 model's, dequantised (the loader's rounding)
    state = dense.state_dict()
    experts = model.decoder.layers[2].mlp.experts
    assert torch.equal(
        dense_weight(experts, "gate_up_proj", dtype), state["decoder.layers.2.mlp.experts.gate_up_proj"]
    )


def _shard_experts(cfg: Glm53Config, shard: ExpertShard, checkpoint) -> GroupedExperts:
    """A MoE layer's experts at `shard`, loaded by the loader (a whole model whose layer-2 experts are that shard)."""
    tconfig = make_transformer_config(cfg, block_fp8_modules=KINDS, block_fp8_block=BLOCK)
    model = glm53_ds.model.Glm53Model(tconfig, mtp=False)
    for layer in model.decoder.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = GroupedExperts(tconfig, shard)
    load_hf_state_into(model, checkpoint, mtp=False)
    return model.decoder.layers[2].mlp.experts


def _shards_hold_their_blocks(checkpoints) -> list[str]:
    root, fp8 = checkpoints
    cfg = Glm53Config.from_hf(fp8)
    whole = glm53_ds.load_hf(str(root / "fp8"), base_quant="none").state_dict()  # dequantised at load
    wrong = []
    for shard in ExpertShard.for_config(cfg, ep=2, etp=2).all_shards():
        experts = _shard_experts(cfg, shard, SafetensorsCheckpoint(str(fp8)))
        for kind in ("gate_up_proj", "down_proj"):
            want = shard.shard(kind, whole[f"decoder.layers.2.mlp.experts.{kind}"])
            if not torch.equal(dense_weight(experts, kind, torch.float32), want):
                wrong.append(f"ep {shard.ep_rank} etp {shard.etp_rank} {kind}")
    return wrong


def test_every_expert_shard_holds_its_blocks(checkpoints):
    assert _shards_hold_their_blocks(checkpoints) == []


def test_a_wrong_block_index_is_caught_control(checkpoints, monkeypatch):
    """Control: block rows counted from the slice's own first row (the offset inside its first block dropped)
    misplace ETP rank 1's scales, and the check above sees it."""

    def from_slice_start(pieces, block):
        table, spans, offset = [], [], 0
        for p in pieces:
            n = (p.length + block - 1) // block
            spans.append(slice(p.start // block, p.start // block + n))
            table.append(offset + torch.arange(p.length) // block)
            offset += n
        return torch.cat(table).to(torch.int32), spans

    monkeypatch.setattr(block_fp8, "block_table", from_slice_start)
    wrong = _shards_hold_their_blocks(checkpoints)
    assert wrong and all("etp 1" in w for w in wrong), wrong


def test_autograd_keeps_no_dequantised_weight(checkpoints):
    _, fp8 = checkpoints
    model = glm53_ds.load_hf(str(fp8), dtype=torch.bfloat16, base_quant="fp8")
    experts = model.decoder.layers[2].mlp.experts
    rows = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([7, 0, 9, 4, 6, 5, 5, 4])
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = experts.ffn(rows, counts)
    out.sum().backward()
    assert rows.grad is not None and experts.gate_up_proj.grad is None
    # kept: offs and h [N, 2I] only; never a weight-shaped tensor in the compute dtype
    weights = {tuple(experts.gate_up_proj.shape[1:]), tuple(experts.down_proj.shape[1:])}
    assert not [t for t in saved if t.dtype == torch.bfloat16 and tuple(t.shape[-2:]) in weights]
    assert {tuple(t.shape) for t in saved} == {(8,), (40, 32)}


def _edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_the_loader_refuses_what_it_cannot_prove(checkpoints, tmp_path):
    root, fp8 = checkpoints
    with pytest.raises(CheckpointError, match=r"stores no weights in block-FP8 \(nothing is quantised\)"):
        glm53_ds.load_hf(str(root / "bf16"), base_quant="fp8")
    # a block size other than the one the scales were made with: every scale shape is refused
    other = save_fp8_copy(root / "bf16", tmp_path / "other_block", BLOCK)
    _edit_config(other, lambda c: c["quantization_config"].update(weight_block_size=[16, 16]))
    with pytest.raises(Fp8FormatError, match=r"layers.0.mlp.down_proj.weight: unknown FP8 scale layout: "
                       r"weight_scale_inv has shape \(3, 5\), expected \(2, 3\) \(16x16 blocks of a 32x48 weight\)"):  # fmt: skip
        glm53_ds.load_hf(str(other), base_quant="fp8")
    # no quantization_config: the block is never assumed (not even 128)
    bare = save_fp8_copy(root / "bf16", tmp_path / "bare", BLOCK)
    _edit_config(bare, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"stored as FP8 but config.json has no quantization_config"):
        glm53_ds.load_hf(str(bare), base_quant="none")
    # '.weight_scale': the quantisation scale or its inverse, unknowable
    spelled = save_fp8_copy(root / "bf16", tmp_path / "spelled", BLOCK)
    from safetensors.torch import load_file, save_file

    file = next(spelled.glob("*.safetensors"))
    tensors = {k.replace("weight_scale_inv", "weight_scale"): v for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(Fp8FormatError, match=r"spelled '.weight_scale' \(e.g. .*\): whether they hold the "):
        SafetensorsCheckpoint(str(spelled))
    # one shared expert left unconverted, the others FP8: a kind stored both ways is refused for residence
    mixed = save_fp8_copy(root / "bf16", tmp_path / "mixed", BLOCK, skip=("layers.3.mlp.shared_experts",))
    with pytest.raises(
        CheckpointError, match=r"the shared experts are stored partly in FP8 .* use --base-quant none"
    ):
        block_fp8_kinds(SafetensorsCheckpoint(str(mixed)), Glm53Config.from_hf(mixed))


def test_modules_not_converted_stay_dense(checkpoints, tmp_path):
    """`modules_to_not_convert` (all shared experts here): they load dense, the rest resident, the same values."""
    root, _ = checkpoints
    path = save_fp8_copy(root / "bf16", tmp_path / "skip", BLOCK, skip=("shared_experts",))
    assert block_fp8_kinds(SafetensorsCheckpoint(str(path)), Glm53Config.from_hf(path)) == (
        "routed_experts",
        "dense_mlp",
    )
    model = glm53_ds.load_hf(str(path), base_quant="fp8")
    shared = model.decoder.layers[2].mlp.shared_experts.linear_fc1.weight
    assert isinstance(shared, torch.nn.Parameter) and shared.dtype == torch.float32
    loss, grads, _ = _loss_and_grads(path, "fp8", torch.float32, "grouped", True)
    want, want_grads, _ = _loss_and_grads(path, "none", torch.float32, "grouped", True)
    assert torch.equal(loss, want) and all(torch.equal(grads[n], want_grads[n]) for n in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_computes_the_reference_products(dtype):
    """The CUDA kernel (`block_fp8_triton`, in Triton's interpreter here) against the torch reference on an ETP-like
    slice (rows 8.. of the stored tensors, partial blocks), an empty group, a group spanning several row tiles, the
    largest e4m3 value and subnormals, both directions. fp32: within 1e-6 of the reference (another order of the same
    sums); bf16: every output within one bf16 rounding (2^-8 relative) of the exact sum of the dequantised products
    (the values both multiply are the same: the dequantised weights round alike)."""
    from glm53_ds.layers import block_fp8_triton
    from glm53_ds.layers.block_fp8 import BlockFp8Weight, BlockLayout, Piece, _grouped_reference

    g = torch.Generator().manual_seed(0)
    layout = BlockLayout((Piece(8, 20), Piece(8, 20)), (Piece(0, 72),), BLOCK)
    rows, cols = layout.tables()
    data = torch.randn(3, 40, 72, generator=g).to(torch.float8_e4m3fn)
    data.view(torch.uint8)[0, 0, :4] = torch.tensor([0x7E, 0x01, 0x81, 0x00], dtype=torch.uint8)
    weight = BlockFp8Weight(data, torch.rand(3, *layout.scale_shape(), generator=g) + 0.5, rows, cols)
    counts = [5, 0, 70]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    for transpose, k in ((True, 72), (False, 40)):
        x = torch.randn(sum(counts), k, generator=g).to(dtype)
        got = block_fp8_triton.grouped_mm(x, data, weight.scale, rows, cols, offs, transpose)
        want = _grouped_reference(x, weight, counts, transpose)
        if dtype == torch.float32:
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
        else:
            exact = torch.cat([xe.double() @ (w.t() if transpose else w) for xe, w in zip(
                torch.split(x, counts), [block_fp8.dequantize(data[e], weight.scale[e], rows, cols, dtype).double()
                                         for e in range(3)], strict=True)])  # fmt: skip
            assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()
