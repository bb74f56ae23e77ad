"""Reading safetensors files without mapping them: the header is parsed once per file, and each tensor (or a range
of its leading dimension) is read with positioned reads into memory of its own.

`safetensors.safe_open` maps the whole file. A tensor viewing that mapping keeps its pages (and the kernel's
fault-around neighbours) resident for as long as it lives, and opening the file anew for every tensor to avoid
that parses the whole header every time: 1.4 ms a tensor on a 6,000-tensor file, which made a conversion of small
tensors run at 13 MB/s. Positioned reads hold exactly the bytes asked for and need no mapping.

Format: an 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__":
{...}}`, then the data, offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_READ = 1 << 30  # one read call moves at most this much (Linux caps a read near 2 GiB)


class SafetensorsFile:
    """One .safetensors file: names, shapes and tensors read on demand (little-endian hosts)."""

    def __init__(self, path: str) -> None:
        if sys.byteorder != "little":
            raise RuntimeError(
                "safetensors data is little-endian; this reader supports little-endian hosts only"
            )
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if length > size - 8:  # bounded before anything is allocated for it
                raise ValueError(
                    f"{path}: not a safetensors file (its header length {length} exceeds the file's {size} bytes)"
                )
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self.data_start = 8 + length

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype (None: one this reader does not know), from the header."""
        return DTYPES.get(self._entry(name)["dtype"])

    def read(self, name: str, index: tuple[int | slice, ...] = ()) -> torch.Tensor:
        """`tensor[index]` as a tensor of its own; only the rows of the leading dimension it needs are read."""
        entry = self._entry(name)
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which is not supported"
            )
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
        local: tuple[int | slice, ...] = ()
        if index and shape:
            lead, rows = index[0], shape[0]
            if isinstance(lead, int):
                if not -rows <= lead < rows:
                    raise IndexError(f"{name}: index {lead} out of range for leading dimension {rows}")
                start, stop = lead % rows, lead % rows + 1
                local = (0,) + tuple(index[1:])
            else:
                start, stop, step = lead.indices(rows)
                if step != 1:
                    raise ValueError(f"{name}: only unit-step slices are read from files, got {lead}")
                stop = max(stop, start)
                local = (slice(None),) + tuple(index[1:]) if len(index) > 1 else ()
            row_bytes = (end - begin) // rows if rows else 0
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
            shape[0] = stop - start
        out = torch.empty(shape, dtype=dtype)
        self._read_into(out, begin, end, name)
        if local:
            out = out[local].clone()  # a tensor of its own, not a view keeping the rows read alive
        return out

    def _entry(self, name: str) -> dict:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _read_into(self, out: torch.Tensor, begin: int, end: int, name: str) -> None:
        buffer = out.reshape(-1).view(torch.uint8).numpy().data  # a writable memoryview of out
        if len(buffer) != end - begin:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes for {len(buffer)} expected"
            )
        done = 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(buffer):
                got = os.preadv(f.fileno(), [buffer[done : done + _MAX_READ]], self.data_start + begin + done)
                if got <= 0:
                    raise ValueError(f"{self.path}: file ends inside tensor {name!r} (truncated?)")
                done += got


def check_plain_file_name(name: object, directory: str) -> None:
    """An index entry names a file of `directory` itself: a plain name, never a path that leaves it (`../x`, `/x`,
    `sub/../../x`), so a reader opens only files the checkpoint's manifest covers."""
    if not isinstance(name, str) or not name or name in (".", "..") or os.path.basename(name) != name:
        raise ValueError(f"{directory}: an index names the file {name!r}, which is not a plain file name of that "
                         "directory (refused: it would be read from outside the checkpoint)")  # fmt: skip


class SafetensorsSet:
    """Tensors spread over the .safetensors files of one directory (`weight_map`: tensor name -> file name), each
    file's header parsed once."""

    def __init__(self, directory: str, weight_map: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.weight_map: dict[str, str] = weight_map if weight_map is not None else {}
        self._files: dict[str, SafetensorsFile] = {}

    def file(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._files:
            check_plain_file_name(file_name, self.directory)
            self._files[file_name] = SafetensorsFile(os.path.join(self.directory, file_name))
        return self._files[file_name]

    def read(self, name: str, index: tuple[int | slice, ...] = ()) -> torch.Tensor:
        return self.file(self.weight_map[name]).read(name, index)

    def shape(self, name: str) -> list[int]:
        return self.file(self.weight_map[name]).shape(name)

    def dtype(self, name: str) -> torch.dtype | None:
        return self.file(self.weight_map[name]).dtype(name)
