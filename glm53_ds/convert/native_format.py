"""The native (training) checkpoint format: named sets of size-bounded safetensors files.

A directory `<ckpt>/<tag>/glm53/` holds
    layout.json                               format, EP, ETP, the Glm53Config, model_only flag
    hf_config.json                            (optional) the config.json the weights came from, kept verbatim
    replicated.index.json + replicated-NNNNN.safetensors              every non-expert tensor
    experts_ep<EEE>_etp<TTT>.index.json + ...-NNNNN.safetensors       one EP x ETP expert shard
Native names are glm53_ds state-dict keys; expert tensors hold the shard's local experts
([E/EP, 2I/ETP, D] and [E/EP, D, I/ETP]). Writers stream (one tensor in memory plus the current output file)
and write every file under a temporary name, renaming it when complete; the index is written last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from .safetensors_file import SafetensorsSet, check_plain_file_name

FORMAT = "glm53_ds-native-v2"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def expert_set_name(ep_rank: int, etp_rank: int) -> str:
    return f"experts_ep{ep_rank:03d}_etp{etp_rank:03d}"


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
        save_file(self._pending, tmp, metadata={"format": "pt"})
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


def latest_tag(load_dir: str) -> str:
    """The tag `<load_dir>/latest` names (the one reading of that file)."""
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint in {load_dir!r}: the file 'latest' is missing")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def write_layout(directory: str, meta: dict) -> None:
    path = os.path.join(directory, "layout.json")
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=2)
    os.replace(tmp, path)


def read_layout(directory: str) -> dict:
    path = os.path.join(directory, "layout.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} is not a glm53_ds checkpoint (no layout.json)")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return meta
