"""What a run trains (training/trainable.py): full fine-tuning, LoRA adapters over a frozen base, patterns; and
LoRA runs end to end (`deepspeed launch/train.py --lora-rank`, packed chat data): EP2 over two ranks with replica checks every step,
checkpoints holding the adapters and buffers without the base, the adapters moved, the export the merged
W + (alpha / r) B A that transformers loads (every other tensor the base, bitwise), a resume in one process over
the recorded base continuing the EP2 curve (losses within 1e-5), other base weights and other adapters refused
naming both, a base checkpoint given fresh adapters and its adapter checkpoint resumed over it."""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel

import glm53_ds
from glm53_ds.checkpoint import CheckpointDir
from glm53_ds.config import Glm53Config
from glm53_ds.convert.__main__ import main as convert_main
from glm53_ds.convert.describe import describe_checkpoint
from glm53_ds.convert.export_adapter import ADAPTER_WEIGHTS
from glm53_ds.layers.lora import LoraSpec, is_lora_param
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.training.config import SetupError
from glm53_ds.training.presets import tiny
from glm53_ds.training.trainable import select_trainable
from tests.cli import (
    QUICK,
    ROOT,
    deepspeed_run,
    metrics,
    one_error,
    run,
    tiny_hf_checkpoint,
    train_config,
    write_hf_checkpoint,
)
from tests.model_fixtures import CONFIG_A, load_hf_reference, rel_err

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")  # packed chat data


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
        (["--trainable", "("], r"--trainable '\(': not a regular expression"),
        (["--export-adapter", "/tmp/glm53-unwritten"], r"--export-adapter without --lora-rank"),
        (
            ["--lora-rank", "4", "--export-adapter", "/tmp/glm53-unwritten", "--trainable", "indexer"],
            r"--trainable 'indexer': the run trains tensors besides the adapters",
        ),
        (
            [
                "--lora-rank",
                "4",
                "--export-adapter",
                "/tmp/glm53-unwritten",
                "--router-bias-update-rate",
                "1e-3",
            ],
            r"--router-bias-update-rate 0.001: the router's correction bias changes",
        ),
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
    hf, other_hf = tmp_path / "hf", tmp_path / "other_hf"
    hf.mkdir()
    other_hf.mkdir()
    tiny_hf_checkpoint(hf)  # the tiny preset: KDA, MLA, dense and MoE layers, MTP
    write_hf_checkpoint(other_hf, tiny(), seed=1)  # the same shapes, other weights
    model = glm53_ds.load_hf(str(hf))
    base = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    common = ["--data", CHAT, "--pack", "--seq-length", "32", "--tokenizer", "bytes", "--lora-rank", "4", "--lora-alpha", "8",
              "--check-replicas-interval", "1", "--lr", "1e-2"]  # fmt: skip
    ck, out, peft_dir = tmp_path / "ck", tmp_path / "export", tmp_path / "peft"
    proc = deepspeed_run(2, *common, "--hf-dir", str(hf), "--ep", "2", "--train-iters", "5", "--save", str(ck),
                         "--save-interval", "3", "--export-hf", str(out), "--export-adapter", str(peft_dir),
                         "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trains LoRA adapters: " in proc.stderr
    assert f"exported {peft_dir} (PEFT LoRA adapter" in proc.stderr
    assert "--export-adapter: the MTP layer's" in proc.stderr  # said, not dropped silently
    # the checkpoint: the adapters and the model's buffers (the router's correction bias), not the frozen base
    saved = CheckpointDir(str(ck))
    assert saved.adapters_only
    stored = {k: saved.full_tensor(k) for k in saved.keys()}
    adapters = {k: v for k, v in stored.items() if is_lora_param(k)}
    buffers = {k for k, _ in model.named_buffers()}
    assert adapters and {k for k in stored if not is_lora_param(k)} <= buffers
    moved = [
        k for k, v in adapters.items() if k.endswith(("lora.B", "gate_up_B", "down_B")) and v.abs().sum() > 0
    ]
    assert len(moved) == len(adapters) // 2  # every B left zero
    # the export: W + 2 B A in fp32 for every adapted tensor, every other tensor the base bitwise
    exported = glm53_ds.load_hf(str(out)).state_dict()
    adapted = set()
    for name, a in adapters.items():
        if name.endswith(".lora.A"):
            owner = name.removesuffix(".lora.A")
            want = base[f"{owner}.weight"] + 2.0 * stored[f"{owner}.lora.B"] @ a
            assert torch.allclose(exported[f"{owner}.weight"], want, rtol=0, atol=1e-6), owner
            adapted.add(f"{owner}.weight")
        elif name.endswith(".lora.gate_up_A"):
            owner = name.removesuffix(".lora.gate_up_A")
            for kind, prefix in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
                b, a_ = stored[f"{owner}.lora.{prefix}_B"], stored[f"{owner}.lora.{prefix}_A"]
                want = base[f"{owner}.{kind}"] + 2.0 * torch.bmm(b, a_)
                assert torch.allclose(exported[f"{owner}.{kind}"], want, rtol=0, atol=1e-6), owner
                adapted.add(f"{owner}.{kind}")
    changed = [k for k in base if k not in adapted and not torch.equal(exported[k], base[k])]
    assert changed == [], changed[:5]  # fp32-kept, router bias, norms, indexer, embeddings: the base
    # the PEFT adapter over transformers' base model gives the merged model's logits (fp32, <= 1e-5)
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = load_hf_reference(str(out))(input_ids=ids).logits
        peft = (
            PeftModel.from_pretrained(load_hf_reference(str(hf)), str(peft_dir)).eval()(input_ids=ids).logits
        )
    assert rel_err(peft, merged) <= 1e-5
    # the same adapter offline from the checkpoint; a merged export of it needs its base: refused
    offline = tmp_path / "peft_offline"
    assert convert_main(["native-to-peft", "--ckpt", str(ck), "--out", str(offline)]) == 0
    assert (offline / ADAPTER_WEIGHTS).read_bytes() == (peft_dir / ADAPTER_WEIGHTS).read_bytes()
    assert convert_main(["native-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "x")]) == 2
    lines: list[str] = []
    assert describe_checkpoint(str(ck), out=lines.append) == 0  # complete without the base
    want = "  LoRA: rank 4, alpha 8, dropout 0, targets mla,kda,mlp,shared_expert,experts; holds the adapters without"
    assert any(line.startswith(want) for line in lines), lines

    # step 3 resumed in one process (EP 1) without --hf-dir: the base it records is loaded (announced), and the
    # run continues the EP2 curve (steps 4-5 within 1e-5)
    proc = run(*common, "--train-iters", "5", "--load", str(ck), "--load-tag", "step3", "--output-dir",
               str(tmp_path / "b"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"base weights: the released-layout weights {hf}, " in proc.stderr
        and " files checksummed" in proc.stderr
    )
    for x, y in zip(metrics(tmp_path / "a")[3:], metrics(tmp_path / "b"), strict=True):
        assert x["step"] == y["step"] and abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x, y)
    # control: other base weights of the same shapes are refused, naming both
    error = one_error(
        run(*common, "--hf-dir", str(other_hf), "--load", str(ck), "--output-dir", str(tmp_path / "c"))
    )
    assert f"--hf-dir {other_hf}: the released-layout weights {other_hf}" in error
    assert f"is not the base these adapters were trained on (the released-layout weights {hf}" in error
    # other adapters: refused, naming both
    error = one_error(run(*QUICK[2:], "--hf-dir", str(hf), "--tokenizer", "bytes", "--lora-rank", "8",
                          "--load", str(ck), "--output-dir", str(tmp_path / "c")))  # fmt: skip
    assert "holds LoRA adapters (rank 4, alpha 8" in error and "this run asks for rank 8, alpha 8" in error
    # a checkpoint without adapters (the export converted back is one) gives the base: fresh adapters, step 0;
    # its adapter checkpoint resumes over that base, read from the recorded checkpoint
    from glm53_ds.convert import hf_to_native

    native = hf_to_native(str(hf), str(tmp_path / "native"))
    proc = run(*common, "--load", native, "--train-iters", "1", "--save", str(tmp_path / "ck2"),
               "--output-dir", str(tmp_path / "d"))  # fmt: skip
    assert proc.returncode == 0 and "loaded the base weights of" in proc.stderr, proc.stderr[-3000:]
    assert "fresh LoRA adapters" in proc.stderr
    proc = run(
        *common, "--load", str(tmp_path / "ck2"), "--train-iters", "2", "--output-dir", str(tmp_path / "e")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"base weights: the checkpoint {native}" in proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "e")] == [2]


@pytest.mark.slow
def test_lora_with_the_optimizer_and_the_activations_offloaded_follows_the_device_run(tmp_path):
    """#61: LoRA at EP2 (ZeRO 2, fp32) with `--offload-optimizer cpu --offload-activations` (full recompute): the
    same losses and gradient norms as with the optimizer on the device within 1e-5 relative over four steps at lr
    1e-2 (DeepSpeedCPUAdam against torch's AdamW: rounding), the adapters moving (the loss falls), and one line saying
    it is rarely worth it."""
    config = tmp_path / "zero2.json"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    common = ["--data", CHAT, "--pack", "--seq-length", "32", "--tokenizer", "bytes", "--lora-rank", "4", "--ep", "2",
              "--lr", "1e-2", "--train-iters", "4", "--recompute", "full", "--offload-activations",
              "--deepspeed_config", str(config)]  # fmt: skip
    device = deepspeed_run(2, *common, "--output-dir", str(tmp_path / "device"))
    assert device.returncode == 0, device.stderr[-3000:]
    host = deepspeed_run(2, *common, "--offload-optimizer", "cpu", "--output-dir", str(tmp_path / "host"))
    assert host.returncode == 0, host.stderr[-3000:]
    assert "--offload-optimizer cpu with LoRA: the adapters' optimizer state is" in host.stderr
    assert "rarely worth it" not in device.stderr
    on_device, on_host = metrics(tmp_path / "device"), metrics(tmp_path / "host")
    assert len(on_host) == 4 and on_host[-1]["lm_loss"] < on_host[0]["lm_loss"]
    for a, b in zip(on_device, on_host, strict=True):
        assert rel_err(torch.tensor(b["lm_loss"]), torch.tensor(a["lm_loss"])) <= 1e-5, (a, b)
        assert rel_err(torch.tensor(b["grad_norm"]), torch.tensor(a["grad_norm"])) <= 1e-5, (a, b)
