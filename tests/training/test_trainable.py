"""What a run trains (training/trainable.py): full fine-tuning, LoRA adapters over a frozen base, patterns; and
LoRA runs end to end (`deepspeed launch/train.py --lora-rank`): EP2 over two ranks with replica checks every step,
the base bitwise unchanged in the checkpoint, the adapters moved, the export the merged W + (alpha / r) B A that
transformers loads, a resume at another layout, a resume with other adapters refused, a base checkpoint given
fresh adapters."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.checkpoint import CheckpointDir
from glm53_ds.config import Glm53Config
from glm53_ds.layers.lora import LoraSpec, is_lora_param
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.training.config import SetupError
from glm53_ds.training.trainable import select_trainable
from tests.cli import QUICK, deepspeed_run, metrics, one_error, run, tiny_hf_checkpoint, train_config
from tests.model_fixtures import CONFIG_A


def _model():
    return glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)


def _trained(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_the_trainable_rules():
    model = _model()
    everything = {n for n, _ in model.named_parameters()}
    indexer = {n for n in everything if ".indexer." in n}
    assert (
        indexer and _trained(model) == everything - indexer
    )  # as built: the indexer trains only by its loss
    apply_lora(model, LoraSpec(rank=2, alpha=2))
    adapters = {n for n, _ in model.named_parameters() if is_lora_param(n)}
    said = select_trainable(model, lora=True, trainable=None, freeze=None, train_indexer=False)
    assert _trained(model) == adapters and said.startswith(f"trains LoRA adapters: {len(adapters)} tensors")
    select_trainable(model, lora=True, trainable=r"\.router\.", freeze=r"layers\.5\.", train_indexer=False)
    routers = {n for n in everything if ".router." in n and "layers.5." not in n}
    assert _trained(model) == (adapters | routers) - {n for n in adapters if "layers.5." in n}
    # an indexer-only warm-up: the backbone frozen, the indexers trained by their loss
    plain = _model()
    select_trainable(plain, lora=False, trainable="indexer", freeze=None, train_indexer=True)
    assert _trained(plain) == indexer
    select_trainable(plain, lora=False, trainable="indexer", freeze=None, train_indexer=False)
    assert _trained(plain) == set()  # without its loss the indexer gets no gradient: it stays frozen


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-alpha", "8"], r"--lora-alpha without --lora-rank"),
        (
            ["--lora-rank", "4", "--lora-targets", "mla,router"],
            r"--lora-targets: LoRA targets \['mla', 'router'\]",
        ),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], r"dropout must be in \[0, 1\)"),
        (["--lora-rank", "4", "--etp", "2"], r"--lora-rank with --etp 2: .* not supported yet"),
        (["--trainable", "("], r"--trainable '\(': not a regular expression"),
    ],
)
def test_bad_fine_tuning_options_are_one_error(argv, message):
    with pytest.raises(SetupError, match=message):
        train_config(*argv)


def test_lora_keeps_the_router_bias():
    assert train_config("--lora-rank", "4").router_bias_update_rate == 0.0
    assert (
        train_config("--lora-rank", "4", "--router-bias-update-rate", "1e-3").router_bias_update_rate == 1e-3
    )
    assert train_config().router_bias_update_rate > 0


@pytest.mark.slow
def test_a_lora_run_under_ep2_trains_the_adapters_only_and_exports_them_merged(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    tiny_hf_checkpoint(hf)  # the tiny preset: KDA, MLA, dense and MoE layers, MTP
    base = {k: v for k, v in glm53_ds.load_hf(str(hf)).state_dict().items() if not k.endswith("_extra_state")}
    common = [*QUICK[2:], "--hf-dir", str(hf), "--tokenizer", "bytes", "--ep", "2", "--lora-rank", "4",
              "--lora-alpha", "8", "--check-replicas-interval", "1", "--lr", "1e-2"]  # fmt: skip
    ck, out = tmp_path / "ck", tmp_path / "export"
    proc = deepspeed_run(2, *common, "--train-iters", "3", "--save", str(ck), "--export-hf", str(out),
                         "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trains LoRA adapters: " in proc.stderr
    saved = CheckpointDir(str(ck))
    stored = {k: saved.full_tensor(k) for k in saved.keys()}
    adapters = {k: v for k, v in stored.items() if is_lora_param(k)}
    assert {k for k in stored if not is_lora_param(k)} == set(base)
    changed = [k for k in base if not torch.equal(stored[k], base[k])]
    assert changed == [], changed[:5]  # the base, router bias and fp32-kept tensors included, bitwise
    moved = [
        k for k, v in adapters.items() if k.endswith(("lora.B", "gate_up_B", "down_B")) and v.abs().sum() > 0
    ]
    assert len(moved) == len(adapters) // 2  # every B left zero
    # the export: W + 2 B A in fp32 for every adapted tensor, the rest the base, loaded as transformers does
    exported = glm53_ds.load_hf(str(out)).state_dict()
    for name, a in adapters.items():
        if name.endswith(".lora.A"):
            owner = name.removesuffix(".lora.A")
            want = base[f"{owner}.weight"] + 2.0 * stored[f"{owner}.lora.B"] @ a
            assert torch.allclose(exported[f"{owner}.weight"], want, rtol=0, atol=1e-6), owner
        elif name.endswith(".lora.gate_up_A"):
            owner = name.removesuffix(".lora.gate_up_A")
            for kind, prefix in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
                b, a_ = stored[f"{owner}.lora.{prefix}_B"], stored[f"{owner}.lora.{prefix}_A"]
                want = base[f"{owner}.{kind}"] + 2.0 * torch.bmm(b, a_)
                assert torch.allclose(exported[f"{owner}.{kind}"], want, rtol=0, atol=1e-6), owner
    kept = [k for k in base if k.endswith(("A_log", "dt_bias", "e_score_correction_bias"))]
    assert kept and all(torch.equal(exported[k], base[k]) for k in kept)  # fp32-kept and unadapted: the base

    # resumed at another layout (two data-parallel ranks, EP 1): it continues, replicas checked every step
    proc = deepspeed_run(2, *[a for a in common if a not in ("--ep", "2")], "--ep", "1", "--train-iters", "5",
                         "--load", str(ck), "--output-dir", str(tmp_path / "b"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "b")] == [4, 5]
    # other adapters: refused, naming both
    error = one_error(run(*QUICK[2:], "--hf-dir", str(hf), "--tokenizer", "bytes", "--lora-rank", "8",
                          "--load", str(ck), "--output-dir", str(tmp_path / "c")))  # fmt: skip
    assert "holds LoRA adapters (rank 4, alpha 8" in error and "this run asks for rank 8, alpha 8" in error
    # a checkpoint without adapters (the export converted back is one) gives the base: fresh adapters, step 0
    from glm53_ds.convert import hf_to_native

    native = hf_to_native(str(hf), str(tmp_path / "native"))
    proc = run(*QUICK[2:], "--tokenizer", "bytes", "--lora-rank", "4", "--load", native, "--train-iters", "1",
               "--output-dir", str(tmp_path / "d"))  # fmt: skip
    assert proc.returncode == 0 and "loaded the base weights of" in proc.stderr, proc.stderr[-3000:]
    assert "fresh LoRA adapters" in proc.stderr
