"""Tensor sets: a named group of size-bounded safetensors files with one index, written streaming, read per tensor.

A set `<name>` is `<name>.index.json` (`{"metadata": {"total_size"}, "weight_map": {key: file}}`) and its files
`<stem>-NNNNN.safetensors`. Writers stream (one tensor in memory plus the current output file) and write every file
under a temporary name, renaming it when complete; the index is written last. Several writers (ranks) may fill one
set, each into files of its own, one of them writing the index from every part. The export to HF writes its
`model.safetensors.index.json` with the same writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from ..safe_io import save_safetensors
from .safetensors_file import SafetensorsSet, check_plain_file_name

DEFAULT_SHARD_BYTES = 2 * 1024**3


class ShardWriter:
    """Write tensors into `<name>-NNNNN.safetensors` files of at most `max_bytes` (one tensor may exceed it).

    Several writers (e.g. ranks) can fill one set together: each gets its own `file_stem` (files
    `<file_stem>-NNNNN.safetensors`) and ends with `finish()`, and one of them writes the set's index from all the
    parts (`write_index`)."""

    def __init__(
        self,
        directory: str,
        name: str,
        max_bytes: int = DEFAULT_SHARD_BYTES,
        index_file: str | None = None,
        file_stem: str | None = None,
    ) -> None:
        self.directory, self.name, self.max_bytes = directory, name, max_bytes
        self.file_stem = file_stem or name
        self.index_file = index_file or f"{name}.index.json"
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self._sizes: list[int] = []
        os.makedirs(directory, exist_ok=True)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[key] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self._sizes.append(nbytes)

    def _flush(self) -> None:
        file = f"{self.file_stem}-{len(self._files) + 1:05d}.safetensors"
        tmp = os.path.join(self.directory, f".{file}.tmp{os.getpid()}")
        save_safetensors(self._pending, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(self.directory, file))
        self._files.append((file, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> tuple[dict[str, str], int]:
        """Write what is pending; this writer's part of the set: (key -> file, bytes)."""
        if self._pending or not self._files:
            self._flush()
        return {k: f for f, keys in self._files for k in keys}, sum(self._sizes)

    def close(self) -> None:
        """`finish`, then the set's index (a set written by this writer alone)."""
        write_index(self.directory, self.index_file, [self.finish()])


def write_index(directory: str, index_file: str, parts: list[tuple[dict[str, str], int]]) -> None:
    """A set's index from its writers' parts (`ShardWriter.finish`), written last, under a temporary name."""
    weight_map = {k: f for part, _ in parts for k, f in part.items()}
    index = {"metadata": {"total_size": sum(n for _, n in parts)}, "weight_map": weight_map}
    path = os.path.join(directory, index_file)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class ShardReader:
    """Read a tensor set written by ShardWriter, one tensor (or one slice of it) at a time."""

    def __init__(self, directory: str, name: str) -> None:
        path = os.path.join(directory, f"{name}.index.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory}: tensor set {name!r} is missing ({name}.index.json)")
        with open(path, encoding="utf-8") as f:
            self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        for file_name in set(self.weight_map.values()):
            check_plain_file_name(file_name, directory)
        self.directory = directory
        self.files = SafetensorsSet(directory, self.weight_map)

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        return self.files.read(key)

    def shape(self, key: str) -> list[int]:
        return self.files.shape(key)

    def get_slice(self, key: str, index: tuple) -> torch.Tensor:
        """`tensor[index]`, reading only the leading-dimension rows the index touches."""
        return self.files.read(key, index)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.weight_map:
            yield key, self.get(key)
