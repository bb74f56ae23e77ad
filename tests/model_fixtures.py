"""Tiny GLM-5.3 checkpoints for the model tests: HF models with non-trivial random weights, saved with
`save_pretrained` (the released layout), and helpers to compare with glm53_ds."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from typing import Any

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.initialization import no_init_weights

from glm53_ds.convert.names import canonical_text_name, released_layout, split_to_released
from tests.hf_reference import BASE_TEXT, VISION

# KDA + DSA (full and shared indexers), dense + MoE, grouped routing, clamping active, sparse selection active
# for sequences longer than index_topk (8).
CONFIG_A: dict[str, Any] = dict(
    BASE_TEXT,
    num_hidden_layers=6,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full", "shared"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    swiglu_limit=0.5,
    index_topk=8,
    index_kpool=4,
    hc_mult=4,
)  # fmt: skip

# Softplus forget gate, 3 streams, no top-k renormalisation, two shared experts, no tail selection.
CONFIG_B: dict[str, Any] = dict(
    BASE_TEXT,
    num_hidden_layers=4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=2,
    norm_topk_prob=False,
    linear_lower_bound=None,
    index_topk=8,
    index_kpool=2,
    index_kpool_always_select_tail=False,
    hc_mult=3,
    hc_sinkhorn_iters=7,
    rms_norm_eps=1e-3,
    swiglu_limit=1.0,
)


def perturb_(model: torch.nn.Module, seed: int = 0, matrix_scale: float = 1.0) -> None:
    """Random weights of realistic scale (HF's init leaves base=0, scale=1, bias=0, tiny activations)."""
    device = next(model.parameters()).device  # draws on the model's device (a big model built on a GPU)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "visual" in name or not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=g, device=device)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * r.abs())
            elif name.endswith("A_log"):
                p.copy_(0.5 * r)
            elif name.endswith(("hc_base", ".base")):
                p.copy_(0.5 * r)
            elif name.endswith(".scale"):
                p.copy_(1 + 0.3 * r)
            elif name.endswith("weight") and p.dim() == 1:
                p.copy_(1 + 0.2 * r)  # norm weights
            elif p.dim() == 1:
                p.copy_(0.3 * r)
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else math.prod(p.shape[1:])
                p.copy_(matrix_scale * r / math.sqrt(fan_in))


def save_tiny_hf(
    path, text: dict[str, Any], seed: int = 0, matrix_scale: float = 1.0, hf_init: bool = True
) -> Glm5NextForConditionalGeneration:
    """`hf_init=False`: without transformers' own initialisation, which perturb_ overwrites in every text weight
    (8 s of a real-width slice's 33 s here); the vision tower, which no test runs, keeps uninitialised memory."""
    torch.manual_seed(seed)
    with contextlib.nullcontext() if hf_init else no_init_weights():
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=VISION))
    perturb_(model, seed, matrix_scale)
    model.save_pretrained(path)
    return model


def load_hf_reference(path, dtype=torch.float32) -> Glm5NextForConditionalGeneration:
    model = Glm5NextForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=dtype)
    return model.eval()


def batch(vocab: int, b: int = 2, s: int = 24, padding: str | None = None, seed: int = 1):
    """input_ids, attention_mask (bool) and labels (-100 on padding) for a batch with optional padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    if padding == "left":
        mask[0, :5] = False
        mask[1, :2] = False
    elif padding == "right":
        mask[0, -6:] = False
        mask[1, -1:] = False
    ids = ids.masked_fill(~mask, 0)
    labels = ids.masked_fill(~mask, -100)
    return ids, mask, labels


def hf_grads_by_native(hf_model, cfg, mtp: bool = False) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """HF parameter gradients regrouped onto glm53_ds native keys: native -> [(index, grad piece)]."""
    layout = released_layout(cfg, mtp=mtp)
    out: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
    for name, p in hf_model.named_parameters():
        text_name = canonical_text_name(name)
        if text_name is None or p.grad is None:
            continue
        for released, piece in split_to_released(text_name, p.grad, cfg):
            for placement in layout[released]:
                out.setdefault(placement.native, []).append((placement.index, piece))
    return out


def check_grads_against_hf(
    model, ref: dict[str, list[tuple[tuple, torch.Tensor]]], bound: float = 1e-4
) -> int:
    """Every gradient of `model` against transformers' (`hf_grads_by_native`), relative to each piece's largest
    entry, <= `bound` (the MTP layer's skipped; the DSA indexer, which HF runs under no_grad, must have none);
    returns how many pieces were compared."""
    checked = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        pieces = ref.get(name)
        if pieces is None:  # HF computes no gradient (the DSA indexer runs under no_grad)
            assert ".indexer." in name, name
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        for index, expected in pieces:
            got = p.grad[index] if index else p.grad
            assert rel_err(got, expected) <= bound, f"{name}{index}: {rel_err(got, expected)}"
            checked += 1
    return checked


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in the wider of the two dtypes and at least fp32 (the difference of two
    nearby fp32 numbers is exact in fp32: no fp64 copies of a 734M-element gradient, tests/test_real_width.py)."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.to(dtype), b.to(dtype)
    return ((a - b).abs().max().double() / b.abs().max().double().clamp_min(1e-30)).item()


def add_mtp_tensors(path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Add random MTP tensors, under their released names, to a `save_pretrained` checkpoint (transformers' model
    has no MTP layer); returns them."""
    from safetensors.torch import load_file, save_file

    import glm53_ds
    from glm53_ds.config import Glm53Config
    from glm53_ds.convert.names import TEXT_PREFIX, released_tensors

    cfg = Glm53Config.from_hf(path)
    donor = glm53_ds.build_model(cfg, mtp=True)
    perturb_(donor.mtp, seed=seed)
    n = cfg.num_hidden_layers
    names = [k for k in released_layout(cfg, mtp=True) if k.startswith(f"{TEXT_PREFIX}layers.{n}.")]
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    added = {k: v.contiguous() for k, v in released_tensors(donor.state_dict(), cfg, True, names)}
    tensors.update(added)
    save_file(tensors, file, metadata={"format": "pt"})
    return added


def engine_config(stage: int, bf16: bool, clip: float) -> dict:
    """A DeepSpeed config for an in-process engine of the tiny model (2 sequences per step, no logging)."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}  # fmt: skip


def read_manifest_json(tag_dir) -> dict:
    """A checkpoint tag's manifest.json as written (`tag_dir`: a pathlib.Path)."""
    return json.loads((tag_dir / "manifest.json").read_text())


def save_lora_native(root, spec, value: float = 0.1) -> pathlib.Path:
    """A converted tiny checkpoint given the adapters of `spec` (value `value`), as a LoRA run saves them with
    its base, and a client state, its manifest rewritten: a tag every reader accepts. Returns the tag directory."""
    from safetensors.torch import load_file, save_file

    import glm53_ds
    from glm53_ds.checkpoint import CLIENT_STATE, CheckpointDir
    from glm53_ds.checkpoint.directory import LAYOUT
    from glm53_ds.convert import hf_to_native
    from glm53_ds.layers.lora import is_lora_param
    from glm53_ds.layers.lora_targets import apply_lora
    from glm53_ds.safe_io import describe_files, list_files, write_manifest
    from tests.cli import tiny_hf_checkpoint

    root = pathlib.Path(root)
    tiny_hf_checkpoint(root / "hf")
    tag = pathlib.Path(hf_to_native(str(root / "hf"), str(root / "native"))) / "hf"
    model_dir = tag / "glm53"
    model = glm53_ds.build_model(CheckpointDir(str(tag)).model_config, mtp=True)
    apply_lora(model, spec)
    adapters = {n: value * torch.ones(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}
    shard = model_dir / "replicated-00001.safetensors"
    save_file({**load_file(str(shard)), **adapters}, str(shard))
    index = json.loads((model_dir / "replicated.index.json").read_text())
    index["weight_map"].update({n: shard.name for n in adapters})
    (model_dir / "replicated.index.json").write_text(json.dumps(index))
    layout = json.loads((model_dir / LAYOUT).read_text())
    (model_dir / LAYOUT).write_text(json.dumps(dict(layout, lora=spec.record())))
    torch.save({"step": 3, "consumed_samples": 12}, str(model_dir / CLIENT_STATE))
    write_manifest(str(tag), describe_files(str(tag), list_files(str(tag))))
    return tag


def restamp(tag_dir, *names: str) -> None:
    """Rewrite the manifest entries of `names` (relative to the tag) after a test edited those files in place: a
    checkpoint whose files are whole again, holding the edit (an older checkpoint, say)."""
    from glm53_ds.safe_io import describe_files, read_manifest, write_manifest

    manifest = read_manifest(str(tag_dir))
    manifest.update(describe_files(str(tag_dir), list(names)))
    write_manifest(str(tag_dir), manifest)


def tiled_step(cfg, tile_bytes: int, **overrides):  # type: ignore[no-untyped-def]
    """One training forward + backward of `cfg` (with MTP) under `moe_tile_bytes` = `tile_bytes` (0: untiled), 2 x 20
    tokens: (model, loss, gradients by name). The tiled layers' tests compare it with and without tiles."""
    import glm53_ds

    torch.manual_seed(0)
    return training_step(glm53_ds.build_model(cfg, mtp=True, moe_tile_bytes=tile_bytes, **overrides))


def training_step(model):  # type: ignore[no-untyped-def]
    """One training forward + backward of `model` on a fixed batch of 2 x 20 tokens: (model, loss, gradients by
    name), for the tests that compare two ways of computing the same step."""
    model.train()
    ids = torch.randint(1, model.glm.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, loss.detach(), grads


def save_fp8_copy(src, dst, block: tuple[int, int], skip: tuple[str, ...] = ()) -> pathlib.Path:
    """A copy of a tiny released checkpoint as the FP8 release stores it: every routed, shared and dense MLP expert
    weight (MTP's too) in float8_e4m3fn with a `weight_scale_inv` per `block`, `quantization_config` in config.json
    (names containing any of `skip` stay as they are: `modules_to_not_convert`)."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from glm53_ds.convert.fp8 import quantize_fp8

    dst = pathlib.Path(dst)
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    pattern = re.compile(r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$")
    for file in files:
        tensors = load_file(file)
        for name in list(tensors):
            if pattern.search(name) and not any(s in name for s in skip):
                tensors[name], tensors[name[: -len(".weight")] + ".weight_scale_inv"] = quantize_fp8(
                    tensors[name], block
                )
        save_file(tensors, file, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f.name for f in files for n in load_file(f)}
        index.write_text(json.dumps(data))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(skip)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst
