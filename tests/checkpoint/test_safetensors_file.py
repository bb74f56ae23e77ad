"""The positioned-read safetensors reader against safetensors' own: every dtype, partial reads, broken files."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53_ds.checkpoint.safetensors_file import SafetensorsFile


@pytest.fixture
def written(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(4, 6, 2, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "f8": torch.randn(3, 8, generator=g).to(torch.float8_e4m3fn),
        "f8e5": torch.randn(3, 8, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(6).reshape(2, 3),
        "i32": torch.arange(4, dtype=torch.int32),
        "u8": torch.arange(10, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def test_reads_every_dtype_bitwise(written):
    path, tensors = written
    f = SafetensorsFile(path)
    assert sorted(f.keys()) == sorted(tensors) and f.metadata == {"format": "pt"}
    with safe_open(path, framework="pt") as ref:
        for name in tensors:
            got, want = f.read(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
            assert f.shape(name) == list(want.shape)


def test_partial_reads_match_indexing(written):
    path, tensors = written
    f = SafetensorsFile(path)
    bf16 = tensors["bf16"]
    for index in [(2,), (-1,), (slice(1, 3),), (slice(0, 4),), (slice(2, 2),), (1, slice(2, 5)), (slice(1, 3), 0),
                  (slice(1, 3), slice(0, 6, 2))]:  # fmt: skip
        got = f.read("bf16", index)
        assert torch.equal(got, bf16[index]), index
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), (
            index
        )  # owns just its bytes


def test_errors_name_the_file_and_tensor(written, tmp_path):
    path, _ = written
    f = SafetensorsFile(path)
    with pytest.raises(KeyError, match="no tensor named 'missing'"):
        f.read("missing")
    with pytest.raises(IndexError, match="out of range"):
        f.read("f32", (5,))
    with pytest.raises(ValueError, match="unit-step"):
        f.read("f32", (slice(0, 4, 2),))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 8])
    with pytest.raises(ValueError, match="file ends inside tensor"):
        SafetensorsFile(str(cut)).read(
            max(SafetensorsFile(path).entries.items(), key=lambda kv: kv[1]["data_offsets"][1])[0]
        )
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00nope")
    with pytest.raises(ValueError, match="header is not JSON"):
        SafetensorsFile(str(junk))
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        SafetensorsFile(str(short))


def test_a_huge_safetensors_header_length_is_one_clear_error(tmp_path):
    """Before: a header length of 2**40 made a bare MemoryError traceback naming no file."""
    from glm53_ds.checkpoint.safetensors_file import SafetensorsFile

    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(
        ValueError, match=rf"{path}: not a safetensors file \(its header length 1099511627776 exceeds"
    ):
        SafetensorsFile(str(path))
