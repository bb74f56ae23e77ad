"""The base weights an adapter checkpoint belongs to: where they were, and a fingerprint to know them again.

A LoRA run's checkpoints hold the adapters, their optimizer state and the run state, not the frozen base
(`save_checkpoint(adapters_only=True)`), so they mean something only over the base they were trained on. The run
records that base (`base_record`): `hf` (a released-layout directory, `--hf-dir`) or `native` (a checkpoint tag
without adapters, `--load`), its path and `fingerprint`. Resuming checks the base it is given, or loads the recorded
one, against it (`check_base`).

The fingerprint reads little at the released size (~100 weight files): a CRC-32 over the model's config file and,
for every `*.safetensors` file under the directory (sorted relative names), its name, size, safetensors header and
three 1 MiB samples of its data (start, middle, end). Another training of the same shapes changes the data, so it
changes the fingerprint; a copy of the same files elsewhere keeps it.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any

from .directory import LAYOUT, resolve

SAMPLE = 1 << 20  # bytes per data sample
HF, NATIVE = "hf", "native"


class BaseMismatch(ValueError):
    pass


def _weight_files(root: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".safetensors")]
    return sorted(out)


def fingerprint(root: str, config_file: str) -> str:
    """The CRC-32 (8 hex digits) of `config_file` (relative to `root`) and of every weight file under `root`."""
    crc = 0
    with open(os.path.join(root, config_file), "rb") as f:
        crc = zlib.crc32(f.read(), crc)
    for name in _weight_files(root):
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        crc = zlib.crc32(f"{name}\0{size}\0".encode(), crc)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (0,)
            crc = zlib.crc32(f.read(header_len), crc)
            start, data = 8 + header_len, max(0, size - 8 - header_len)
            for at in sorted({start, start + max(0, data // 2 - SAMPLE // 2), start + max(0, data - SAMPLE)}):
                f.seek(at)
                crc = zlib.crc32(f.read(SAMPLE), crc)
    return f"{crc:08x}"


def base_record(kind: str, path: str, tag: str | None = None) -> dict[str, Any]:
    """What a checkpoint records of its base: `hf` (a released-layout directory) or `native` (a checkpoint; `tag`
    None: its `latest`), with the resolved tag and the fingerprint."""
    if kind == HF:
        return dict(kind=HF, path=os.path.abspath(path), fingerprint=fingerprint(path, "config.json"))
    if kind != NATIVE:
        raise ValueError(f"base weights of kind {kind!r}: expected {HF!r} or {NATIVE!r}")
    _, model_dir = resolve(path, tag)
    return dict(kind=NATIVE, path=os.path.abspath(path), tag=tag,
                fingerprint=fingerprint(model_dir, LAYOUT))  # fmt: skip


def describe_base(record: dict[str, Any]) -> str:
    where = record["path"] + (f" (tag {record['tag']})" if record.get("tag") else "")
    what = "the released-layout weights" if record["kind"] == HF else "the checkpoint"
    return f"{what} {where}, fingerprint {record['fingerprint']}"


def check_base(recorded: dict[str, Any], given: dict[str, Any], option: str) -> None:
    """Refuse base weights `given` (by `option`) that are not the `recorded` ones, naming both."""
    if given["fingerprint"] != recorded["fingerprint"]:
        raise BaseMismatch(f"{option}: {describe_base(given)} is not the base these adapters were trained on "
                           f"({describe_base(recorded)}); give that base, or export the adapters from a run "
                           "over it")  # fmt: skip
