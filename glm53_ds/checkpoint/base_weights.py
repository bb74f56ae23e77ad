"""The base weights an adapter checkpoint belongs to: where they were, and the full checksum of every file.

A LoRA run's checkpoints hold the adapters, their optimizer state and the run state, not the frozen base
(`save_checkpoint(adapters_only=True)`), so they mean something only over the base they were trained on. The run
records that base (`base_record`): `hf` (a released-layout directory, `--hf-dir`) or `native` (a checkpoint tag
without adapters, `--load`), its path and `files`: every file that makes the weights, with its size and CRC-32.
Resuming checks the base it is given, or loads the recorded one, against it (`check_base`), naming the first file
that differs.

- `hf`: `config.json`, every `*.safetensors` and `*.safetensors.index.json` under the directory, each read whole.
  A run reads them anyway; the checksums are spread over the ranks (`checksums`: each rank a round-robin share,
  one gather), so at the released size (~640 GB) each of 8 ranks reads ~80 GB once, at ~3 GB/s of CRC-32.
- `native`: the tag's manifest, whose CRCs the reader verifies against the files before it loads them (every
  reader checks the manifest), so the record costs nothing to make.
A copy of the same files elsewhere keeps the record; one changed byte anywhere changes it.

Checkpoints written before the full checksums record a `fingerprint` over three 1 MiB samples per file (their
header, size and name): such a record is still checked that way (`sampled_fingerprint`), and the run says that
the check covers samples only.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ..safe_io import describe_files, read_manifest
from .directory import LAYOUT, resolve

SAMPLE = 1 << 20  # bytes per data sample (the sampled fingerprint of older records)
HF, NATIVE = "hf", "native"
HF_CONFIG_FILE = "config.json"


class BaseMismatch(ValueError):
    pass


def weight_files(root: str) -> list[str]:
    """The files of a released-layout directory that make its weights (sorted relative names)."""
    out = []
    for folder, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, f), root) for f in files
                if f.endswith((".safetensors", ".safetensors.index.json"))]  # fmt: skip
    return sorted(out + [HF_CONFIG_FILE])


# (root, names) -> {name: {size, crc32}}: `describe_files`, or the trainer's collective `shared_checksums`
Checksums = Callable[[str, Sequence[str]], dict[str, dict[str, object]]]


def base_record(
    kind: str, path: str, tag: str | None = None, checksums: Checksums = describe_files
) -> dict[str, Any]:
    """What a checkpoint records of its base: `hf` (a released-layout directory) or `native` (a checkpoint; `tag`
    None: its `latest`), with every file's size and CRC-32."""
    if kind == HF:
        return dict(kind=HF, path=os.path.abspath(path), files=checksums(path, weight_files(path)))
    if kind != NATIVE:
        raise ValueError(f"base weights of kind {kind!r}: expected {HF!r} or {NATIVE!r}")
    tag_dir, _ = resolve(path, tag)
    manifest = read_manifest(tag_dir)
    files = {n: {"size": e.get("size"), "crc32": e.get("crc32")} for n, e in sorted(manifest.items())}
    return dict(kind=NATIVE, path=os.path.abspath(path), tag=tag, files=files)


def describe_base(record: dict[str, Any]) -> str:
    where = record["path"] + (f" (tag {record['tag']})" if record.get("tag") else "")
    what = "the released-layout weights" if record["kind"] == HF else "the checkpoint"
    if "files" in record:
        return f"{what} {where}, {len(record['files'])} files checksummed"
    return f"{what} {where}, sampled fingerprint {record['fingerprint']}"


def check_base(recorded: dict[str, Any], given: dict[str, Any], option: str) -> str | None:
    """Refuse base weights `given` (by `option`) that are not the `recorded` ones, naming both and the first file
    that differs. Returns a notice when the record is an older, sampled one (checked as it was made)."""
    notice = None
    if "files" in recorded:
        want, have = recorded["files"], given["files"]
        differ = [f"{n} is missing" for n in want if n not in have]
        differ += [f"{n} differs ({have[n]['size']} bytes, CRC-32 {have[n]['crc32']}; recorded "
                   f"{want[n]['size']} bytes, {want[n]['crc32']})" for n in want if n in have and have[n] != want[n]]  # fmt: skip
        differ += [f"{n} is not in the recorded base" for n in have if n not in want]
    else:
        notice = (f"{option}: the checkpoint records its base by a sampled fingerprint (written before full "
                  "checksums): the base is checked on samples of each file only")  # fmt: skip
        if given["kind"] == HF:
            found = sampled_fingerprint(given["path"], HF_CONFIG_FILE)
        else:  # the tag's model directory and its layout.json
            found = sampled_fingerprint(resolve(given["path"], given.get("tag"))[1], LAYOUT)
        differ = [] if found == recorded["fingerprint"] else [f"sampled fingerprint {found}"]
    if differ:
        raise BaseMismatch(f"{option}: {describe_base(given)} is not the base these adapters were trained on "
                           f"({describe_base(recorded)}): {'; '.join(differ[:3])}; give that base, or export the "
                           "adapters from a run over it")  # fmt: skip
    return notice


def sampled_fingerprint(root: str, config_file: str) -> str:
    """The fingerprint records made before full checksums hold: a CRC-32 of `config_file` and, for every
    `*.safetensors` under `root`, its name, size, header and three 1 MiB samples of its data."""
    crc = 0
    with open(os.path.join(root, config_file), "rb") as f:
        crc = zlib.crc32(f.read(), crc)
    names = []
    for folder, _, files in os.walk(root):
        names += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".safetensors")]
    for name in sorted(names):
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
