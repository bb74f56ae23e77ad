"""Packed fine-tuning data: chat rendering with assistant-only targets, greedy packing with boundaries, the same
global batch at any layout, and the global token-mean loss (world 2 x GAS 2 == one process on the whole batch)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import glm53_ds
from glm53_ds.convert.__main__ import main as convert_main
from glm53_ds.training.data import ByteTokenizer, HFTokenizer, open_stream
from glm53_ds.training.packing import IGNORE_INDEX, byte_chat_template, chat_messages, pack, render_chat
from glm53_ds.training.presets import preset
from tests.cli import ROOT, deepspeed_run, metrics, python_run

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} [end] {% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _word_tokenizer(path) -> HFTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[EOS]", "[PAD]", "[system]", "[user]", "[assistant]", "[end]",
             "be", "brief", "hi", "hello", "there", "how", "are", "you", "fine", "thanks"]  # fmt: skip
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]", pad_token="[PAD]"
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return HFTokenizer(str(path))


def test_chat_labels_are_the_assistant_tokens(tmp_path):
    tok = _word_tokenizer(tmp_path / "tok")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"},
    ]
    ids, trained = render_chat(tok, messages, "test:1")
    words = tok.tok.convert_ids_to_tokens(ids)
    assert " ".join(words) == ("[system] be brief [end] [user] hi [end] [assistant] hello there [end] "
                               "[user] how are you [end] [assistant] fine thanks [end]")  # fmt: skip
    assert [w for w, t in zip(words, trained, strict=True) if t] == [
        "hello",
        "there",
        "[end]",
        "fine",
        "thanks",
        "[end]",
    ]
    # packed labels: the tokens where trained, -100 elsewhere (system / user / role headers)
    tokens, labels, starts, _, counts = pack(iter([(ids, trained)]), seq_length=32, pad_id=2)
    row = labels[0, : len(ids)]
    assert (row[np.asarray(trained)] == np.asarray(ids)[np.asarray(trained)]).all()
    assert (row[~np.asarray(trained)] == IGNORE_INDEX).all()
    assert (labels[0, len(ids) :] == IGNORE_INDEX).all() and starts[0] == [
        0,
        len(ids),
    ]  # padding: own document
    assert counts["targets"] == 6


def test_byte_template_and_prompt_completion():
    tok = ByteTokenizer()
    messages = chat_messages({"prompt": "Hi?", "completion": "Yes."}, "x:1")
    ids, trained = render_chat(tok, messages, "x:1")
    assert bytes(ids[:-1]).decode() == "<|user|>\nHi?\n<|assistant|>\nYes.\n" and ids[-1] == tok.eod_id
    assert bytes(i for i, t in zip(ids, trained, strict=True) if t and i < 256).decode() == "Yes.\n"
    assert trained[-1]  # the end of the conversation is a target after an assistant turn
    empty = render_chat(tok, chat_messages({"prompt": "Hi?", "completion": ""}, "x:2"), "x:2")
    assert sum(empty[1]) == 2  # an empty assistant turn trains its end-of-turn newline and the end token
    assert byte_chat_template(messages[:1], add_generation_prompt=True) == list(
        b"<|user|>\nHi?\n<|assistant|>\n"
    )


def test_bad_chat_lines_name_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"question": "?"}) + "\n"
    )
    with pytest.raises(ValueError, match=rf"{path}:2: a chat line needs 'messages'"):
        open_stream(str(path), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: messages\[0\] must be"):
        open_stream(str(path), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)


def test_packing_splits_long_documents_and_keeps_boundaries():
    docs = [([1] * 5, [True] * 5), ([2] * 12, [True] * 12), ([3] * 3, [True] * 3)]
    tokens, labels, starts, real, counts = pack(iter(docs), seq_length=8, pad_id=0)
    # greedy: [1]*5 | pad ; [2]*8 ; [2]*4 [3]*3 | pad
    assert tokens.tolist() == [[1] * 5 + [0] * 3, [2] * 8, [2] * 4 + [3] * 3 + [0]]
    assert starts == [[0, 5], [0], [0, 4, 7]] and real == [5, 8, 7]
    assert counts == dict(
        documents=3, pieces=4, real_tokens=20, targets=4 + 7 + 3 + 2, no_target_documents=0, long_documents=1
    )


def test_global_batch_is_the_same_rows_at_any_world_size(tmp_path):
    stream = open_stream(CHAT, ByteTokenizer(), str(tmp_path), 64, 7, 300, pack=False)
    one = stream.micro_batch(8, 0, 0, 1, 4).input_ids.reshape(4, 64)
    two = [stream.micro_batch(8, m, r, 2, 1).input_ids for m in range(2) for r in range(2)]
    assert torch.equal(one, torch.cat(two))
    batch = stream.micro_batch(0, 0, 0, 1, 2)
    assert batch.cu_seqlens[0] == 0 and batch.cu_seqlens[-1] == 128 and batch.input_ids.shape == (1, 128)


def test_token_mean_over_micro_batches_equals_the_whole_batch():
    """The micro-batch losses with token normalizers, averaged as DeepSpeed averages them (over accumulation steps
    and ranks), have the gradient of one forward over the whole global batch; the mean of per-micro-batch means
    (the old loss) does not, since the micro-batches hold different numbers of targets (the control)."""
    torch.manual_seed(0)
    model = glm53_ds.build_model(preset("tiny"), mtp=True)
    g = torch.Generator().manual_seed(0)
    micro = []
    for n_targets in (3, 20, 9, 14):
        ids = torch.randint(1, 64, (1, 24), generator=g)
        labels = ids.clone()
        labels[0, : 24 - n_targets] = IGNORE_INDEX
        micro.append((ids, labels, torch.tensor([0, 10, 24])))
    counts = torch.stack([model.count_targets(lab, cu_seqlens=cu) for _, lab, cu in micro]).sum(0)
    norms = counts.double() / len(micro)

    def grads(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    split = grads(
        lambda: sum(model(i, labels=lab, cu_seqlens=cu, token_normalizers=norms) for i, lab, cu in micro) / 4
    )
    ids = torch.cat([m[0] for m in micro], 1)
    labels = torch.cat([m[1] for m in micro], 1)
    cu = torch.tensor([0, 10, 24, 34, 48, 58, 72, 82, 96])
    whole = grads(lambda: model(ids, labels=labels, cu_seqlens=cu))
    means = grads(lambda: sum(model(i, labels=lab, cu_seqlens=cu) for i, lab, cu in micro) / 4)
    assert ((split - whole).abs().max() / whole.abs().max()).item() <= 1e-5
    assert ((means - whole).abs().max() / whole.abs().max()).item() > 1e-2


@pytest.mark.slow
def test_two_ranks_two_accumulation_steps_equal_one_process_on_the_global_batch(tmp_path):
    """Chat data, world 2 x GAS 2 x micro 1 vs one process x micro 4 (one forward over the 4 rows): the first
    step's logged loss and gradient norm agree; the rows hold different numbers of targets."""
    common = ["--data", CHAT, "--train-iters", "1", "--global-batch-size", "4", "--seed", "3"]
    two = deepspeed_run(2, *common, "--micro-batch-size", "1", "--output-dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    one = python_run(*common, "--micro-batch-size", "4", "--output-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = metrics(tmp_path / "two")[0], metrics(tmp_path / "one")[0]
    assert a["target_tokens"] == b["target_tokens"]
    assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * b["lm_loss"], (a, b)
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a, b)
    stream = open_stream(CHAT, ByteTokenizer(), str(tmp_path / "one" / "data_cache"), 64, 3, 300, False)
    per_row = [int((stream.micro_batch(0, 0, r, 4, 1).labels[0, 1:] != IGNORE_INDEX).sum()) for r in range(4)]
    assert len(set(per_row)) > 1, per_row  # unequal targets: a mean of means would differ


@pytest.mark.slow
def test_tiny_chat_run_trains_on_assistant_tokens(tmp_path):
    proc = python_run("--data", CHAT, "--train-iters", "24", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = metrics(tmp_path / "run")
    assert all("packing_efficiency" in r and r["target_tokens"] >= 0 for r in records)
    first = np.mean([r["lm_loss"] for r in records[:4] if r["target_tokens"]])
    last = np.mean([r["lm_loss"] for r in records[-4:] if r["target_tokens"]])
    assert last < first - 0.5, (first, last)


@pytest.mark.slow
def test_packed_chat_resume_is_bitwise(tmp_path, capsys):
    """Packed rows resume at their consumed-sample position: steps 3-4 after a resume from step 2 equal the
    uninterrupted run's bitwise. `convert describe` reports the training checkpoint complete, with its layout."""
    common = ["--data", CHAT, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4"]
    first = python_run(*common, "--save-interval", "2", "--save", str(tmp_path / "ckpt"),
                       "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    assert convert_main(["describe", str(tmp_path / "ckpt"), "--tag", "step2"]) == 0
    report = capsys.readouterr().out
    assert "world size 1, EP 1, ETP 1, SP 1, ZeRO stage 0, dtype fp32, with optimizer state" in report, report
    assert "resumable at: any layout (layout-free optimizer state, step 2)" in report and "complete" in report
    again = python_run(*common, "--load", str(tmp_path / "ckpt"), "--load-tag", "step2",
                       "--output-dir", str(tmp_path / "b"))  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    uninterrupted, resumed = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(uninterrupted[2:], resumed, strict=True):
        assert (a["lm_loss"], a["grad_norm"], a["target_tokens"]) == (
            b["lm_loss"],
            b["grad_norm"],
            b["target_tokens"],
        )


@pytest.mark.slow
def test_sequence_parallel_run_equals_one_process(tmp_path):
    """Packed chat rows, world 2 with --sp 2 (both ranks read the same rows, each computes half of every row) vs
    one process with the same global batch and accumulation, the MoE balance loss and the DSA indexer loss on
    (refused under SP before the attention split by query): the same target count, packing and per-step losses
    (<= 1e-5) and gradient norm (<= 1e-4), over two steps; replicas checked every step. Setting --seq-length to a
    length SP does not divide is refused before any work."""
    common = ["--data", CHAT, "--pack", "--train-iters", "2", "--global-batch-size", "2", "--seed", "3",
              "--micro-batch-size", "1", "--aux-loss-coef", "0.01", "--indexer-loss-coef", "0.1",
              "--seq-length", "64"]  # fmt: skip
    sp = deepspeed_run(
        2, *common, "--sp", "2", "--check-replicas-interval", "1", "--output-dir", str(tmp_path / "sp")
    )
    assert sp.returncode == 0, sp.stdout[-2000:] + sp.stderr[-2000:]
    one = python_run(*common, "--output-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    for a, b in zip(metrics(tmp_path / "sp"), metrics(tmp_path / "one"), strict=True):
        assert a["target_tokens"] == b["target_tokens"] and a["packing_efficiency"] == b["packing_efficiency"]
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * b["lm_loss"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)  # with the balance loss
        assert abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 * b["mtp_loss"], (a, b)
        # the indexer loss here is a small KL (1.4e-5: sums of nearly cancelling log-ratios): 2.2e-4 relative, 3e-9
        # absolute, measured; each shard's mean over its own queries instead of the row's would be 2x
        assert (
            b["indexer_loss"] > 0 and abs(a["indexer_loss"] - b["indexer_loss"]) <= 1e-3 * b["indexer_loss"]
        )
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a, b)
    bad = deepspeed_run(2, *common[:-1], "63", "--sp", "2", "--output-dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "seq_length 63 is not divisible by SP = 2" in bad.stderr, bad.stderr[
        -2000:
    ]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


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


def test_a_raising_chat_template_and_a_deeply_nested_line_name_file_and_line(tmp_path):
    """Before: both ended in a traceback (jinja's TemplateError from the template's own `raise_exception`, a
    RecursionError from the JSON parser). Now one error each naming file and line."""
    tok = _word_tokenizer(tmp_path / "tok")
    tok.tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    )
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]  # fmt: skip
    path.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"messages": messages}) + "\n"
    )
    with pytest.raises(ValueError, match=rf"{path}:2: the tokenizer's chat template failed on messages\[0\] "
                                         r"\(TemplateError: no system turns\)"):  # fmt: skip
        open_stream(str(path), tok, str(tmp_path / "c"), 64, 1, 300, pack=False)
    path.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"
    )
    with pytest.raises(ValueError, match=rf"{path}:2: a JSON line nested too deeply to read"):
        open_stream(str(path), ByteTokenizer(), str(tmp_path / "d"), 64, 1, 300, pack=False)


def test_openai_content_parts_are_their_texts_joined():
    """Before: `"content": [{"type": "text", "text": ...}]` (OpenAI-style parts) was refused as not a string. Now
    the text parts are joined as the released chat template's `visible_text` joins them, and the rendered rows are
    the string form's; a part of another type is one error naming it."""
    from glm53_ds.training.packing import chat_messages

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "two "}, "parts"]},
                          {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}  # fmt: skip
    plain = {"messages": [{"role": "user", "content": "two parts"}, {"role": "assistant", "content": "ok"}]}
    assert chat_messages(parts, "f:1") == chat_messages(plain, "f:1")
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(
        ValueError, match=r"f:2: messages\[0\]\.content\[0\] must be \{'type': 'text'.*'image_url'"
    ):
        chat_messages(image, "f:2")
    with pytest.raises(ValueError, match=r"f:3: messages\[0\]\.content\[1\] must be .* got type 'text'"):
        chat_messages({"messages": [{"role": "user", "content": ["a", {"type": "text", "text": 3}]}]}, "f:3")
