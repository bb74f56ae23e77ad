"""Nothing lost, second pass (issue 24): a non-finite update is never applied nor saved, a fresh run never replaces
another run's checkpoints, one writer per --save, every checkpoint reader checks the manifest, data caches and resume
identity follow content, no-target chat data is refused, the chunked head refuses bad labels, index names stay in
their directory, bounded safetensors headers, re-saving over a linked tag, the user's weights-only switch. Each test
says what the old code did (the control it would have failed), and most run that control."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import glm53_ds
from glm53_ds import safe_io
from glm53_ds.config import Glm53Config
from glm53_ds.engine import NonFiniteGradientError
from tests.model_fixtures import CONFIG_A
from tests.test_nothing_lost import QUICK, one_error, run
from tests.test_train import deepspeed_run


# ----------------------------------------------------------------------------- 1. non-finite updates
def _ds_config(stage: int, bf16: bool, clip: float) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}  # fmt: skip


POISON = "decoder.layers.0.self_attention.q_proj.weight"


def _poisoned_step(engine, poison: str) -> None:
    """One forward + backward + step whose loss is finite but whose gradient holds a NaN (in `poison`)."""
    handle = dict(engine.module.named_parameters())[poison].register_hook(lambda g: g * float("nan"))
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = engine(ids, labels=ids)
    assert torch.isfinite(loss)
    engine.backward(loss)
    try:
        engine.step()
    finally:
        handle.remove()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if t is not None}


@pytest.mark.parametrize(
    "stage, bf16, clip",
    [(0, False, 1.0), (0, False, 0.0), (0, True, 1.0), (1, False, 1.0), (1, True, 1.0), (2, True, 1.0),
     (2, True, 0.0), (2, False, 1.0)],
)  # fmt: skip
def test_a_nan_gradient_changes_no_weight_at_any_stage(stage, bf16, clip):
    """Before: stage 0 fp32 (the CPU default) and ZeRO bf16 (the GPU default) applied the NaN update; now every
    optimizer path raises NonFiniteGradientError at the step and no tensor of the model changes (bitwise)."""
    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(stage, bf16, clip))
    before = _weights(engine.module)
    with pytest.raises(NonFiniteGradientError, match="global gradient norm is"):
        _poisoned_step(engine, POISON)
    after = _weights(engine.module)
    assert [n for n in before if not torch.equal(before[n], after[n])] == []


@pytest.mark.parametrize("stage, bf16, clip", [(0, False, 1.0), (0, False, 0.0), (2, True, 1.0)])
def test_control_without_the_guards(stage, bf16, clip, monkeypatch):
    """The control, the old code (guards taken out): stage 0 fp32 writes NaN into the weights; ZeRO-2 bf16 skips the
    update itself but `step()` returns as if it had been taken, so the trainer went on (and counted the step)."""
    from glm53_ds.engine import build, deepspeed_internals

    monkeypatch.setattr(deepspeed_internals, "_refuse_non_finite", lambda norm: None)
    monkeypatch.setattr(build, "install_step_guard", lambda engine: None)
    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(stage, bf16, clip))
    _poisoned_step(engine, POISON)  # no error
    finite = torch.isfinite(dict(engine.module.named_parameters())[POISON]).all()
    assert (not finite) if stage == 0 else (finite and not engine.was_step_applied())


def test_a_model_holding_nan_is_never_saved(tmp_path):
    """Before: save_checkpoint wrote NaN weights and moved `latest` to them; now it refuses before writing."""
    from glm53_ds.checkpoint import CheckpointError
    from glm53_ds.engine import save_checkpoint

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(0, False, 1.0))
    save_checkpoint(engine, str(tmp_path), "step1")
    with torch.no_grad():
        engine.module.embedding.weight[3, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"refusing to save .*step2: embedding.weight \(rank 0\)"):
        save_checkpoint(engine, str(tmp_path), "step2")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1"]
    assert (tmp_path / "latest").read_text() == "step1"


@pytest.mark.slow
def test_a_huge_learning_rate_stops_at_the_last_good_checkpoint(tmp_path):
    """The issue's run: --lr 1e9 --save-interval 1. Before: step 2's NaN update was applied, saved as step2 (83 NaN
    tensors), `latest` moved there and the stop named it. Now the step-2 update is refused, step1 stays latest, the
    stop names it, and step1 is whole and finite."""
    ck = tmp_path / "ck"
    proc = run(*QUICK[2:], "--train-iters", "4", "--lr", "1e9", "--save", str(ck), "--save-interval", "1",
               "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "gradient norm is nan at step 2" in errors[0], proc.stderr[-2000:]
    assert f"The last checkpoint this run saved is {ck / 'step1'}" in errors[0]
    assert (ck / "latest").read_text() == "step1" and not (ck / "step2").exists()
    from glm53_ds.convert.export_hf import load_native

    model = load_native(str(ck))  # step1: whole, verified, and finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- 2. / 3. whose --save it is
@pytest.mark.slow
def test_a_fresh_run_never_replaces_another_runs_checkpoints(tmp_path):
    """Before: a run without --load pointed at an existing --save replaced that run's step2 (rc 0, no word). Now it
    is refused before any work, naming the tags and the three ways on; resuming there, or --save-into-existing,
    still writes there."""
    ck = tmp_path / "ck"
    first = run(*QUICK, "--save", str(ck), "--output-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (ck / "step2" / "manifest.json").read_text()
    error = one_error(run(*QUICK, "--lr", "1e-2", "--save", str(ck), "--output-dir", str(tmp_path / "b")))
    assert f"--save '{ck}' already holds checkpoints (step2; latest: step2)" in error, error
    assert f"--load {ck}" in error and "--save-into-existing" in error
    assert (ck / "step2" / "manifest.json").read_text() == saved  # untouched
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # refused before any work
    # told to: it writes there (its own step2 replaces the other's)
    proc = run(
        *QUICK, "--lr", "1e-2", "--save", str(ck), "--save-into-existing", "--output-dir", str(tmp_path / "c")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ck / "step2" / "manifest.json").read_text() != saved


def test_the_writer_lock_and_its_stale_rule(tmp_path):
    """One writer per directory: a running owner (this process) is refused, a dead one on this host is taken over
    with a notice, another host's lock is refused; a lock is released only by its own writer."""
    first = safe_io.DirectoryLock(str(tmp_path), "--save")
    assert first.acquire() is None
    with pytest.raises(
        safe_io.OutputPathError, match=rf"being written by another run \(host .*, pid {os.getpid()}"
    ):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path = tmp_path / safe_io.LOCK_FILE
    owner = json.loads(lock_path.read_text())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    lock_path.write_text(
        json.dumps(dict(owner, pid=int(dead.stdout), started=None, run="x"))
    )  # a killed run's lock
    second = safe_io.DirectoryLock(str(tmp_path), "--save")
    notice = second.acquire()
    assert notice is not None and f"stale lock of pid {int(dead.stdout)}" in notice
    first.release()  # no longer its lock: left alone
    assert json.loads(lock_path.read_text())["run"] == second.run_id
    lock_path.write_text(json.dumps(dict(owner, host="another-node", run="y")))
    with pytest.raises(safe_io.OutputPathError, match="host another-node"):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path.write_text(json.dumps(dict(owner, run=second.run_id)))
    second.release()
    assert not lock_path.exists()


@pytest.mark.slow
def test_a_second_writer_of_a_save_directory_is_refused(tmp_path):
    """Before: two concurrent runs on one --save interleaved their tags and moved `latest` backwards (both rc 0).
    Now the second is refused at set-up, naming the first run's lock (held here by this test process)."""
    lock = safe_io.DirectoryLock(str(tmp_path / "ck"), "--save")
    lock.acquire()
    try:
        error = one_error(run(*QUICK, "--save", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "a")))
        assert "is being written by another run" in error and f"pid {os.getpid()}" in error, error
        assert os.listdir(tmp_path / "ck") == [safe_io.LOCK_FILE]
    finally:
        lock.release()
    proc = run(*QUICK, "--save", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "ck" / safe_io.LOCK_FILE).exists()  # released at the end


# ----------------------------------------------------------------------------- 4. / 9. / 10. readers
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from glm53_ds.convert import hf_to_native
    from tests.test_train import _tiny_hf_checkpoint

    base = tmp_path_factory.mktemp("converted")
    _tiny_hf_checkpoint(base / "hf")
    return base, hf_to_native(str(base / "hf"), str(base / "native"), ep=2)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def test_every_reader_checks_the_manifest(converted, tmp_path):
    """Before: one flipped byte made --load refuse, but native-to-hf wrote `lm_head.weight[100] = -1.1e37` (and
    verify / load_native read it). Now each refuses, naming the file, and the export writes nothing."""
    from glm53_ds.convert import native_to_hf, verify
    from glm53_ds.convert.export_hf import load_native

    base, native = converted
    damaged = tmp_path / "damaged"
    shutil.copytree(native, damaged)
    shard = sorted((damaged / "hf" / "glm53").glob("replicated-*.safetensors"))[0]
    _flip_a_byte(shard)
    message = rf"damaged or incomplete: glm53/{shard.name} does not match its checksum"
    with pytest.raises(ValueError, match=message):
        native_to_hf(str(damaged), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=message):
        verify(str(base / "hf"), str(damaged), out=lambda *a: None)
    with pytest.raises(ValueError, match=message):
        load_native(str(damaged))
    # control: the undamaged checkpoint exports
    native_to_hf(native, str(tmp_path / "good"))
    assert (tmp_path / "good" / "model.safetensors.index.json").exists()


def test_index_entries_stay_inside_the_checkpoint(converted, tmp_path):
    """Before: an index entry `../x.safetensors` read a file outside the checkpoint that the manifest never checked;
    describe said complete and the resume ran. Now the readers and describe refuse it (the manifest rewritten to
    match, as an attacker who knows the format would)."""
    from glm53_ds.convert.describe import describe_checkpoint
    from glm53_ds.convert.export_hf import load_native

    _, native = converted
    copy = tmp_path / "copy"
    shutil.copytree(native, copy)
    model_dir = copy / "hf" / "glm53"
    shard = sorted(model_dir.glob("replicated-*.safetensors"))[0]
    shutil.move(str(shard), str(tmp_path / shard.name))  # outside the checkpoint
    index = json.loads((model_dir / "replicated.index.json").read_text())
    index["weight_map"] = {
        k: ("../../../" + v if v == shard.name else v) for k, v in index["weight_map"].items()
    }
    (model_dir / "replicated.index.json").write_text(json.dumps(index))
    tag = copy / "hf"
    entries = json.loads((tag / "manifest.json").read_text())["files"]
    del entries[f"glm53/{shard.name}"]
    safe_io.write_manifest(
        str(tag), entries | safe_io.describe_files(str(tag), ["glm53/replicated.index.json"])
    )
    rows: list[str] = []
    assert describe_checkpoint(str(copy), out=rows.append) == 1
    assert any("not a plain file name" in r for r in rows), rows
    with pytest.raises(ValueError, match=r"names the file '\.\./\.\./\.\./replicated-"):
        load_native(str(copy))
    # the manifest itself may not point outside either
    with pytest.raises(ValueError, match="a path outside the checkpoint directory"):
        safe_io.write_manifest(str(tag), entries | {"../elsewhere.bin": {"size": 1, "crc32": "0"}})
        safe_io.read_manifest(str(tag))


def test_a_huge_safetensors_header_length_is_one_clear_error(tmp_path):
    """Before: a header length of 2**40 made a bare MemoryError traceback naming no file."""
    from glm53_ds.checkpoint.safetensors_file import SafetensorsFile

    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(
        ValueError, match=rf"{path}: not a safetensors file \(its header length 1099511627776 exceeds"
    ):
        SafetensorsFile(str(path))


# ----------------------------------------------------------------------------- 11. / 12. saves and loads
def test_a_tag_that_is_a_link_is_resaved_and_its_target_kept(tmp_path):
    """Before: re-saving a tag that was a symlink killed the run (`rmtree` on a link). Now the link is replaced by
    the new tag and what it pointed at stays whole."""
    from glm53_ds.engine import save_checkpoint

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(0, False, 1.0))
    ck = tmp_path / "ck"
    save_checkpoint(engine, str(ck), "step1")
    shutil.move(str(ck / "step1"), str(tmp_path / "archived"))
    os.symlink(tmp_path / "archived", ck / "step1")
    save_checkpoint(engine, str(ck), "step1")
    assert (ck / "step1").is_dir() and not (ck / "step1").is_symlink()
    assert (tmp_path / "archived" / "manifest.json").exists()
    assert sorted(os.listdir(ck)) == ["latest", "step1"]


def test_the_users_no_weights_only_switch_does_not_break_checkpoint_loads(tmp_path, monkeypatch):
    """Before: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in the environment made every same-layout resume crash (torch
    refuses both switches at once). Now checkpoint loads lift it meanwhile, still refuse pickled objects, and put
    it back."""
    from glm53_ds.engine.deepspeed_internals import weights_only_loads

    path = tmp_path / "state.pt"
    torch.save({"step": 3, "t": torch.ones(2)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="Only one of"):  # the control: what DeepSpeed's load met
        torch.load(path, weights_only=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with weights_only_loads():
        assert torch.load(path, weights_only=False)["step"] == 3
    torch.save({"bad": _Opens(str(tmp_path / "marker"))}, tmp_path / "bad.pt")
    with (
        pytest.raises(ValueError, match="refused to load a checkpoint file holding pickled objects"),
        weights_only_loads(),
    ):
        torch.load(tmp_path / "bad.pt", weights_only=False)
    assert not (tmp_path / "marker").exists()
    assert (
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
        and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    )


class _Opens:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


# ----------------------------------------------------------------------------- 5. / 6. / 8. data
def test_caches_follow_the_tokenizer_and_data_contents(tmp_path):
    """Before: the cache key was the tokenizer's path and the data's size + mtime: after the chat template was edited
    in place (or the data edited keeping size and mtime) the old rows were reused. Now both are content-keyed."""
    from glm53_ds.training.data import HFTokenizer, open_stream
    from tests.test_packed_data import _word_tokenizer

    _word_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    data.write_text(json.dumps(line) + "\n")
    cache = tmp_path / "cache"

    def rows() -> tuple[list[str], list[int]]:
        stream = open_stream(
            str(data), HFTokenizer(str(tmp_path / "tok")), str(cache), 32, 1, 300, pack=False
        )
        return sorted(os.listdir(cache)), stream.tokens[0].tolist()

    names, before = rows()
    template = tmp_path / "tok" / "chat_template.jinja"  # where transformers saves the chat template
    template.write_text(template.read_text().replace("[end]", "[end] [end]"))
    names2, after = rows()
    assert len(names2) == len(names) + 1 and after != before  # rebuilt
    stat = os.stat(data)
    data.write_text(json.dumps(line).replace("hello there", "there hello") + "\n")  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    names3, edited = rows()
    assert len(names3) == len(names2) + 1 and edited != after


def test_chat_data_without_targets_is_refused_and_counted(tmp_path):
    """Before: conversations with no assistant turn trained three steps of loss 0 (rc 0) while weight decay still
    moved the checkpoint. Now data with no target at all is refused, naming the file; a part without is reported."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(user_only) + "\n") * 3)
    with pytest.raises(
        ValueError, match=rf"--data {data}: none of its 3 conversations has a token to train on"
    ):
        open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    data.write_text(json.dumps(user_only) + "\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    stream = open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    assert stream.notices == [f"--data {data}: 1 of 2 conversations have no token to train on (context only)"]


def test_data_errors_name_the_file(tmp_path):
    """Before: non-UTF-8 data and a damaged cache raised messages naming no file."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: not UTF-8 text \(byte 0xff"):
        open_stream(str(bad), ByteTokenizer(), str(tmp_path / "c"), 8, 1, 300, pack=False)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    open_stream(str(chat), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    packed = next(p for p in (tmp_path / "c").iterdir() if p.name.endswith(".packed"))
    (packed / "labels.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=rf"the packed data cache {packed} is damaged"):
        open_stream(str(chat), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)


def test_another_corpus_of_the_same_size_has_another_identity(tmp_path):
    """Before: the data identity was (tokens, seq_length, seed): a corpus of the same size resumed."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog " * 20)
    b.write_text("the lazy dog jumps over the quick brown fox " * 20)
    ia = open_stream(str(a), ByteTokenizer(), str(tmp_path / "c"), 16, 1, 300, pack=False).identity
    ib = open_stream(str(b), ByteTokenizer(), str(tmp_path / "c"), 16, 1, 300, pack=False).identity
    assert {k: v for k, v in ia.items() if k != "fingerprint"} == {
        k: v for k, v in ib.items() if k != "fingerprint"
    }
    assert ia["fingerprint"] != ib["fingerprint"]


@pytest.mark.slow
def test_a_resume_on_another_corpus_is_refused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog " * 20)
    b.write_text("the lazy dog jumps over the quick brown fox " * 20)
    ck = tmp_path / "ck"
    proc = run(*QUICK, "--data", str(a), "--save", str(ck), "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = one_error(run(*QUICK[2:], "--train-iters", "3", "--data", str(b), "--load", str(ck), "--save", str(ck),
                          "--output-dir", str(tmp_path / "o")))  # fmt: skip
    assert "the data differs from the checkpoint's (fingerprint" in error, error


# ----------------------------------------------------------------------------- 7. the chunked head
@pytest.mark.parametrize("label", [-1, 96, -7])
def test_the_chunked_head_refuses_labels_outside_the_vocabulary(label):
    """Before: label -1 was trained as class 0 by the chunked head, where the materialised head and transformers
    raise. Now both heads refuse every label outside [0, V) except the ignore index."""
    from glm53_ds.layers.chunked_ce import linear_cross_entropy

    hidden, weight = torch.randn(6, 8), torch.randn(96, 8)
    target = torch.tensor([1, 2, -100, label, 5, 6])
    with pytest.raises((RuntimeError, IndexError)):  # the control: cross_entropy's contract
        torch.nn.functional.cross_entropy(hidden @ weight.t(), target)
    for chunk_bytes in (4 * 96 * 2, 0):
        with pytest.raises(RuntimeError, match=r"a target is outside \[0, 96\)"):
            linear_cross_entropy(hidden, weight, target, chunk_bytes=chunk_bytes)
    target[3] = 7
    assert torch.isfinite(linear_cross_entropy(hidden, weight, target, chunk_bytes=4 * 96 * 2))


# ----------------------------------------------------------------------------- one error line per failure
@pytest.mark.slow
@pytest.mark.parametrize("case", ["before the process group", "after it"])
def test_a_two_rank_refusal_is_reported_once(tmp_path, case):
    """Before: every rank printed the same refusal (two `error:` lines at two ranks)."""
    args = ["--seq-length", "0"] if case == "before the process group" else ["--ep", "3"]
    proc = deepspeed_run(2, *args, "--train-iters", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error: " in line]
    assert len(errors) == 1, errors
