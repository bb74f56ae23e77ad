"""A run does what its user meant (issue 25): a resume keeps the checkpoint's global batch, a converted checkpoint
trains as the model it holds, defaults follow the model (not the route it came by), every export carries a
tokenizer transformers loads, the run says what it did (save / resume / export, one line each, the same loss
names everywhere), chat data in its common shapes with the long-conversation policy reported, a converter verdict.
Each test says what the old code did (its control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm53_ds.training.args import build_parser
from glm53_ds.training.config import TrainConfig
from tests.test_nothing_lost import QUICK, one_error, run
from tests.test_train import ROOT, TRAIN, deepspeed_run, metrics, write_hf_checkpoint


def _hf_dir(path, cfg, mtp: bool = True, seed: int = 0) -> None:
    write_hf_checkpoint(path, cfg, mtp=mtp, seed=seed)


def _config(*argv: str) -> TrainConfig:
    return TrainConfig.from_args(build_parser().parse_args(list(argv)))


# ----------------------------------------------------------------------------- 1. the batch a resume keeps
@pytest.mark.slow
def test_a_resume_at_another_layout_keeps_the_global_batch(tmp_path):
    """Before: without --global-batch-size the batch came from the layout: an EP2 checkpoint (4 per step) resumed in
    one process trained with 2 (consumed 12 -> 14 -> 16; steps 4-5 off the uninterrupted curve). Now the
    checkpoint's batch is kept (16, 20; the uninterrupted losses within 1e-5); another one given on purpose is
    announced in one line."""
    ck = tmp_path / "ck"
    common = [*QUICK[2:], "--micro-batch-size", "2"]
    full = deepspeed_run(2, *common, "--ep", "2", "--train-iters", "5", "--save", str(ck), "--save-interval", "3",
                         "--output-dir", str(tmp_path / "full"))  # fmt: skip
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = run(*common, "--train-iters", "5", "--load", str(ck), "--load-tag", "step3", "--output-dir",
                  str(tmp_path / "resumed"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck / 'step3'}: step 3, 12 consumed samples, global batch 4" in resumed.stderr
    a, b = metrics(tmp_path / "full")[3:], metrics(tmp_path / "resumed")
    assert [r["consumed_samples"] for r in b] == [16, 20]
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x, y)
    other = run(*common, "--train-iters", "4", "--load", str(ck), "--load-tag", "step3", "--global-batch-size", "2",
                "--output-dir", str(tmp_path / "other"))  # fmt: skip
    assert other.returncode == 0, other.stderr[-3000:]
    assert (
        "--global-batch-size 2: the checkpoint trained with 4 sequences per step; this run continues with 2"
        in (other.stderr)
    )
    assert [r["consumed_samples"] for r in metrics(tmp_path / "other")] == [14]


# ----------------------------------------------------------------------------- 2. / 4. the model a checkpoint holds
def test_defaults_follow_the_model_not_the_route(tmp_path):
    """Before: the same tiny weights trained at router-bias rate 1e-2 into runs/tiny as a converted checkpoint and
    at 1e-3 into runs/hf by --hf-dir. Now both are the tiny preset's, and another model gets the general ones."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.training.presets import tiny

    _hf_dir_path = tmp_path / "hf"
    _hf_dir_path.mkdir()
    _hf_dir(_hf_dir_path, tiny())
    native = hf_to_native(str(_hf_dir_path), str(tmp_path / "native"))
    by_hf = _config("--hf-dir", str(_hf_dir_path), "--tokenizer", "bytes")
    by_load = _config("--load", native)
    for config in (by_hf, by_load):
        assert config.router_bias_update_rate == 1e-2 and config.output_dir == os.path.join("runs", "tiny")
    other = tmp_path / "wide"
    other.mkdir()
    _hf_dir(other, tiny().replace(hidden_size=48))
    wide = _config("--hf-dir", str(other), "--tokenizer", "bytes")
    assert wide.router_bias_update_rate == 1e-3 and wide.output_dir == os.path.join("runs", "wide")


@pytest.mark.slow
def test_a_converted_checkpoint_trains_as_the_model_it_holds(tmp_path):
    """Before: `--load <converted>` built the tiny preset and refused any other model ("hidden_size: 48 in the
    checkpoint, 64 here"); with --model-config it then failed on missing mtp.0.* until --no-mtp. Now it builds the
    checkpoint's own model, with MTP only where the checkpoint holds its tensors, and says what it loaded."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.training.presets import tiny

    hf = tmp_path / "hf"
    hf.mkdir()
    _hf_dir(
        hf, tiny().replace(hidden_size=48), mtp=False
    )  # the config says 1 MTP layer, the weights have none
    native = hf_to_native(str(hf), str(tmp_path / "native"), ep=1)
    proc = run(*QUICK, "--load", native, "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded the weights of" in proc.stderr and "(fresh optimizer state, step 0" in proc.stderr
    assert all("mtp_loss" not in r for r in metrics(tmp_path / "o"))


# ----------------------------------------------------------------------------- 3. every export carries its tokenizer
def test_the_byte_tokenizer_exports_as_a_real_tokenizer(tmp_path):
    """The byte tokenizer written as tokenizer files: AutoTokenizer encodes and renders chats (tool calls included)
    exactly as training did."""
    from transformers import AutoTokenizer

    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer
    from glm53_ds.training.data import ByteTokenizer

    write_byte_tokenizer(str(tmp_path))
    tok, ours = AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer()
    text = "héllo wörld \n\t 🙂 <|user|>"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert (len(tok), tok.eos_token_id, tok.pad_token_id) == (258, ours.eod_id, ours.pad_id)
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]  # fmt: skip
    for head in (messages[:2], messages):
        for prompt in (False, True):
            rendered = tok.apply_chat_template(
                head, tokenize=True, add_generation_prompt=prompt, return_dict=False
            )
            assert list(rendered) == ours.chat_template_ids(head, add_generation_prompt=prompt)


@pytest.mark.slow
def test_an_export_is_loadable_and_trains_again_as_hf_dir(tmp_path):
    """Before: with the byte tokenizer (or --tokenizer DIR) --export-hf wrote no tokenizer and no
    generation_config.json, and the export fed back as --hf-dir failed inside transformers, once per rank."""
    from transformers import AutoTokenizer

    export = tmp_path / "export"
    proc = run(*QUICK, "--output-dir", str(tmp_path / "a"), "--export-hf", str(export))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {export}" in proc.stderr
    assert AutoTokenizer.from_pretrained(export).encode("ab", add_special_tokens=False) == [97, 98]
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 256
    again = run(*QUICK, "--hf-dir", str(export), "--output-dir", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow
def test_a_missing_tokenizer_is_one_error_naming_the_option(tmp_path):
    """Before: a --hf-dir without tokenizer files failed inside transformers ("install sentencepiece")."""
    from glm53_ds.training.presets import tiny

    hf = tmp_path / "hf"
    hf.mkdir()
    _hf_dir(hf, tiny())
    error = one_error(run(*QUICK, "--hf-dir", str(hf), "--output-dir", str(tmp_path / "o")))
    assert f"--tokenizer '{hf}': no tokenizer there" in error and "--tokenizer bytes" in error, error


# ----------------------------------------------------------------------------- 5. the run says what it did
@pytest.mark.slow
def test_saves_resumes_and_names_are_said(tmp_path):
    """Before: no line for a save, a resume or an export; the console's `loss` was the LM loss while metrics.jsonl's
    `loss` is the total. Now each is one line with its path, and the log line uses metrics.jsonl's names."""
    ck = tmp_path / "ck"
    proc = run(*QUICK, "--save", str(ck), "--log-interval", "1", "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"saved {ck / 'step2'} (step 2, 4 consumed samples)" in proc.stderr
    record = metrics(tmp_path / "a")[-1]
    final = next(line for line in proc.stdout.splitlines() if line.startswith("final: "))
    assert f"lm_loss {record['lm_loss']:.4f}" in final and f"loss {record['loss']:.4f}" in final
    assert f"mtp_loss {record['mtp_loss']:.4f}" in final


# ----------------------------------------------------------------------------- 6. chat data
def test_chat_shapes_map_to_messages():
    """Before: only `messages` (system / user / assistant) and prompt + completion were accepted."""
    from glm53_ds.training.packing import chat_messages

    share = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}, {"from": "observation", "value": "o"}]}  # fmt: skip
    assert [m["role"] for m in chat_messages(share, "f:1")] == ["system", "user", "assistant", "tool"]
    alpaca = {"instruction": "add", "input": "1 1", "output": "2"}
    assert chat_messages(alpaca, "f:2") == [{"role": "user", "content": "add\n\n1 1"},
                                            {"role": "assistant", "content": "2"}]  # fmt: skip
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "content": "r", "tool_call_id": "1"}]}  # fmt: skip
    out = chat_messages(tools, "f:3")
    assert (
        out[1] == {"role": "assistant", "content": "", "tool_calls": [call]} and out[2]["tool_call_id"] == "1"
    )
    with pytest.raises(ValueError, match=r"f:4: messages\[1\]\.content must be a string, got int"):
        chat_messages(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}, "f:4"
        )
    with pytest.raises(ValueError, match=r"f:5: conversations\[0\]\.from must be one of"):
        chat_messages({"conversations": [{"from": "bot", "value": "x"}]}, "f:5")
    with pytest.raises(ValueError, match=r"f:6: conversations\[0\]\.value must be a string"):
        chat_messages({"conversations": [{"from": "human", "value": None}]}, "f:6")


@pytest.mark.parametrize("policy, rows, said", [("split", 5, "split into row-sized pieces"),
                                                ("truncate", 3, "cut to their first row"), ("drop", 1, "left out")])  # fmt: skip
def test_long_conversations_follow_the_policy_and_are_reported(tmp_path, policy, rows, said):
    """Before: 24 conversations were cut into 54 pieces at the default --seq-length without a word."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    data = tmp_path / "chat.jsonl"
    lines = [{"prompt": "q", "completion": "a"}] + [{"prompt": "q" * 10, "completion": "a" * 90}] * 2
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stream = open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, False, policy)
    assert stream.num_samples == rows
    assert any(
        f"2 of 3 conversations are longer than --seq-length 64 and were {said}" in n for n in stream.notices
    )


# ----------------------------------------------------------------------------- 7. start-up and the converter
@pytest.mark.slow
def test_help_is_not_preceded_by_warnings():
    """Before: five Apex / Transformer-Engine warnings and DeepSpeed's accelerator guess came before the usage."""
    proc = subprocess.run(
        [sys.executable, TRAIN, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: deepspeed launch/train.py")
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr[-2000:]


def test_verify_ends_with_a_verdict(tmp_path):
    """Before: `convert verify` printed a table and 'max difference' but no verdict."""
    from glm53_ds.convert import hf_to_native, verify
    from glm53_ds.training.presets import tiny

    hf = tmp_path / "hf"
    hf.mkdir()
    _hf_dir(hf, tiny())
    native = hf_to_native(str(hf), str(tmp_path / "native"))
    rows: list[str] = []
    assert verify(str(hf), native, out=rows.append) == 0.0
    assert rows[-1].startswith("verify: OK (") and rows[-1].endswith(" tensors equal)")
    rows = []
    other = tmp_path / "other"
    other.mkdir()
    _hf_dir(other, tiny(), seed=1)  # another model of the same shapes
    verify(str(hf), hf_to_native(str(other), str(tmp_path / "n2")), out=rows.append)
    assert rows[-1].startswith("verify: FAILED (") and "tensors differ, max |diff|" in rows[-1], rows[-1]


# ----------------------------------------------------------------------------- 8. the docs' examples run
@pytest.mark.slow
def test_the_conversion_docs_commands_run_as_written(tmp_path):
    """docs/conversion.md's first block, run with its paths pointed at a tiny released checkpoint (the commands and
    options as written): hf-to-native at EP 8 x ETP 2, native-to-hf with a template, verify's verdict."""
    import re

    from glm53_ds.training.presets import tiny

    hf = tmp_path / "GLM-5.3-Flash"
    hf.mkdir()
    _hf_dir(hf, tiny())
    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer

    write_byte_tokenizer(str(hf))
    text = open(os.path.join(ROOT, "docs", "conversion.md"), encoding="utf-8").read()
    block = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]
    paths = {"/ckpt/GLM-5.3-Flash": str(hf), "/ckpt/native-ep8": str(tmp_path / "native-ep8"),
             "/ckpt/run1-hf": str(tmp_path / "run1-hf"), "/ckpt/run1": str(tmp_path / "native-ep8")}  # fmt: skip
    for line in block.strip().splitlines():
        command = line.split(" [", 1)[0]  # an optional flag shown in brackets
        for old, new in paths.items():
            command = command.replace(old, new)
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.strip().splitlines()[-1].startswith("verify: OK")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "run1-hf").encode("a", add_special_tokens=False) == [97]
