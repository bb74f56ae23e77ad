"""What one `--data` entry names, decided from the path alone (no rows read), in the first seconds of a run.

Forms (`ACCEPTED_FORMS`):
  - a megatron indexed dataset prefix (`<prefix>.bin` + `<prefix>.idx`);
  - a `.jsonl` file: rows, one JSON object per line (read here, so an error names file:line);
  - a `.json` file (JSON Lines, as `Dataset.to_json` writes, or one JSON array), `.parquet`, `.arrow`, `.csv`:
    rows, read by `datasets`; a `.json` is never text;
  - a folder or a glob of such shards (one kind), read by `datasets.load_dataset` with its split inference
    (`train-00000-of-00004.parquet`, `data/test.jsonl`, ...);
  - a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (`FOLDER:SPLIT`), memory-mapped by
    `datasets.load_from_disk`;
  - a hub dataset id `owner/name[:SPLIT]` found in the local Hugging Face cache (`hf download --repo-type dataset
    owner/name` fetches it; nothing is downloaded at run time);
  - any other file that is UTF-8 text: one document (`.txt`).
A split defaults to `train` (or the only split); `PATH:SPLIT` picks another, `PATH:SPLIT:WEIGHT` weighs it.

A source's content fingerprint (`fingerprint`) keys its caches and is recorded in checkpoints: the files' bytes
(`content_hash`: whole up to a budget, else sampled), or for a hub snapshot the blob names, which are the files'
content hashes already.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

# datasets' packaged builder of each row-file extension
ROW_EXTENSIONS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}
# files that are surely not text: refused at once instead of read as a document
NOT_TEXT = (".tsv", ".xlsx", ".xls", ".zip", ".gz", ".bz2", ".xz", ".zst", ".tar", ".pkl", ".pickle", ".pt",
            ".pth", ".npy", ".npz", ".h5", ".hdf5", ".safetensors", ".feather", ".orc", ".avro", ".db", ".sqlite",
            ".bin", ".idx")  # fmt: skip
ACCEPTED_FORMS = ("an indexed dataset prefix (.bin/.idx); a .jsonl, .json (JSON Lines or an array), .parquet, .arrow "
                  "or .csv file of rows; a folder or glob of such shards; a Dataset/DatasetDict.save_to_disk folder "
                  "(FOLDER:SPLIT); a hub dataset id owner/name[:SPLIT] in the local Hugging Face cache; a UTF-8 "
                  "text file (one document)")  # fmt: skip
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SPLIT_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")
WHOLE_HASH_BYTES = 1 << 30  # files up to this size are hashed whole; larger ones are sampled
SOURCE_HASH_BUDGET = (
    1 << 30
)  # a source of several files: this many bytes hashed whole in all (each file >= 64 MiB)


@dataclass(frozen=True)
class Source:
    """One data source as resolved from its entry. `kind`: `indexed` (a prefix), `text` (one document), `jsonl`
    (rows read here) or `rows` (rows read by `datasets`). For `rows`, `loader` is `load_from_disk` (a save_to_disk
    folder) or `load_dataset` (`builder` with `files`, or the folder `path` when `builder` is None)."""

    entry: str  # the path as given, with its split (the --data entry without its weight)
    path: str
    kind: str
    form: str  # in words, for messages
    files: tuple[str, ...]  # what the content fingerprint covers
    split: str | None = None
    loader: str = ""
    builder: str | None = None
    hub: bool = False

    @property
    def named(self) -> str:
        """How messages name it: the entry, with the split it reads."""
        return f"{self.path} (split {self.split})" if self.split else self.path


def content_hash(paths: Sequence[str], whole_bytes: int = WHOLE_HASH_BYTES) -> str:
    """A fingerprint of the files' contents (names aside): each file's size and its bytes, read whole up to
    `whole_bytes`; of a larger file 256 blocks of 64 KiB spread evenly over it, the first and last included (a
    corpus of hundreds of GB is not read at every start; a different corpus still differs)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        size = os.path.getsize(path)
        digest.update(f"{size}|".encode())
        with open(path, "rb") as f:
            if size <= whole_bytes:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                continue
            block, count = 1 << 16, 256
            for i in range(count):
                f.seek((size - block) * i // (count - 1))
                digest.update(f.read(block))
    return digest.hexdigest()


def fingerprint(source: Source) -> str:
    """The source's content fingerprint (module docstring). A single file hashes as `content_hash` always did, so
    the caches and checkpoints of earlier runs keep their keys."""
    if source.hub:  # blobs are named by their content hash: the names are the fingerprint
        digest = hashlib.blake2b(digest_size=16)
        for f in source.files:
            digest.update(
                f"{os.path.relpath(f, source.path)}|{os.path.basename(os.path.realpath(f))}|".encode()
            )
        return digest.hexdigest()
    if source.kind != "rows" or len(source.files) == 1:  # a file, or an indexed prefix's .idx + .bin
        return content_hash(source.files)
    whole = max(64 << 20, SOURCE_HASH_BUDGET // len(source.files))
    names = "|".join(os.path.relpath(f, source.path) if os.path.isdir(source.path) else os.path.basename(f)
                     for f in source.files)  # fmt: skip
    return hashlib.blake2b(
        f"{names}|{content_hash(source.files, whole)}".encode(), digest_size=16
    ).hexdigest()


def _row_files(folder: str) -> list[str]:
    """The row files under `folder` (recursively, hidden entries skipped), sorted."""
    found = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found += [os.path.join(directory, f) for f in files if not f.startswith(".") and _extension(f) in ROW_EXTENSIONS]  # fmt: skip
    return sorted(found)


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _one_builder(files: Sequence[str], where: str) -> str:
    builders = sorted({ROW_EXTENSIONS[_extension(f)] for f in files})
    if len(builders) > 1:
        kinds = sorted({_extension(f) for f in files})
        raise ValueError(f"{where} holds shards of several kinds ({', '.join(kinds)}); give one kind (a glob such "
                         "as DIR/*.parquet)")  # fmt: skip
    return builders[0]


def hub_cache_dir() -> str:
    """Where the Hugging Face hub cache is (HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_snapshot(repo: str, option: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return str(snapshot_download(repo, repo_type="dataset", local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"{option} {repo!r}: neither a path nor a dataset in the local Hugging Face cache "
                                f"({cache}); nothing is downloaded at run time: fetch it once with `hf download "
                                f"--repo-type dataset {repo}` (same HF_HOME / HF_HUB_CACHE), or give its files' "
                                f"path ({type(e).__name__})") from None  # fmt: skip


def _split_of(path: str) -> tuple[str, str | None]:
    """(path, split) of `PATH:SPLIT` when PATH names data (or a hub id) and PATH:SPLIT does not."""
    head, sep, tail = path.rpartition(":")
    if (
        sep
        and head
        and not _exists(path)
        and SPLIT_NAME.match(tail)
        and (_exists(head) or HUB_ID.match(head))
    ):
        return head, tail
    return path, None


def _exists(path: str) -> bool:
    return os.path.exists(path) or (os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx"))


def _saved_splits(folder: str) -> list[str] | None:
    """The splits of a save_to_disk folder: [] for a Dataset, names for a DatasetDict, None for neither."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
            return [str(s) for s in json.load(f).get("splits", [])]
    if os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(
        os.path.join(folder, "dataset_info.json")
    ):
        return []
    return None


def _pick_split(split: str | None, splits: Sequence[str], where: str) -> str:
    if split is None:
        if "train" in splits or len(splits) != 1:
            split = "train"
        else:
            split = splits[0]
    if split not in splits:
        raise ValueError(f"{where}: no split {split!r}; it has {', '.join(map(repr, splits)) or 'none'} (pick one "
                         "as PATH:SPLIT)")  # fmt: skip
    return split


def resolve_source(entry: str, option: str = "--data", named: str | None = None) -> Source:
    """The source `entry` names (module docstring); FileNotFoundError / ValueError with one line naming `option`,
    the entry (as given: `named`) and, for an unknown form, the forms accepted."""
    path, split = _split_of(entry)
    where = f"{option} {(named or entry)!r}"
    if os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx") and not os.path.isdir(path):
        return Source(entry, path, "indexed", "an indexed dataset", (path + ".idx", path + ".bin"))
    if os.path.isfile(path):
        ext = _extension(path)
        if ext == ".jsonl" and split is None:
            return Source(entry, path, "jsonl", "a .jsonl file", (path,))
        if ext in ROW_EXTENSIONS:
            return Source(
                entry, path, "rows", f"a {ext} file", (path,), split, "load_dataset", ROW_EXTENSIONS[ext]
            )
        if ext in NOT_TEXT or split is not None:
            raise ValueError(f"{where}: not a form {option} reads; it takes {ACCEPTED_FORMS}")
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 4:  # not a character cut at the end of the sample
                raise ValueError(f"{where}: neither UTF-8 text (byte 0x{head[e.start]:02x} at offset {e.start}) "
                                 f"nor a form {option} reads by name; it takes {ACCEPTED_FORMS}") from None  # fmt: skip
        return Source(entry, path, "text", "a text file (one document)", (path,))
    if os.path.isdir(path):
        return _folder_source(entry, path, split, where)
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(f"{where}: the glob matches no file")
        unknown = [f for f in files if _extension(f) not in ROW_EXTENSIONS]
        if unknown:
            raise ValueError(f"{where}: the glob matches {unknown[0]!r}, not a row file "
                             f"({', '.join(ROW_EXTENSIONS)})")  # fmt: skip
        builder = _one_builder(files, where)
        return Source(entry, path, "rows", f"a glob of {len(files)} {_extension(files[0])} shards", tuple(files),
                      split, "load_dataset", builder)  # fmt: skip
    if HUB_ID.match(path):
        snapshot = _hub_snapshot(path, option)
        files = [f for f in _all_files(snapshot)]
        source = _folder_source(entry, snapshot, split, where)
        return Source(entry, snapshot, "rows", f"the hub dataset {path} (local cache)", tuple(files), source.split,
                      source.loader, source.builder, hub=True)  # fmt: skip
    raise FileNotFoundError(f"{where}: neither a file, a folder, an indexed dataset prefix (.bin/.idx) nor a hub "
                            f"dataset id; {option} takes {ACCEPTED_FORMS}")  # fmt: skip


def _all_files(folder: str) -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if not f.startswith(".")
    )


def _folder_source(entry: str, folder: str, split: str | None, where: str) -> Source:
    splits = _saved_splits(folder)
    if splits is not None:
        if not splits:
            if split is not None:
                raise ValueError(
                    f"{where}: a Dataset.save_to_disk folder has no splits; give it without ':{split}'"
                )
            files = tuple(_all_files(folder))
            return Source(
                entry, folder, "rows", "a Dataset.save_to_disk folder", files, None, "load_from_disk"
            )
        split = _pick_split(split, splits, where)
        files = tuple(_all_files(os.path.join(folder, split)))
        return Source(
            entry, folder, "rows", "a DatasetDict.save_to_disk folder", files, split, "load_from_disk"
        )
    shards = _row_files(folder)
    if not shards:
        raise ValueError(f"{where}: the folder holds no row files ({', '.join(ROW_EXTENSIONS)}) and is no "
                         f"save_to_disk folder; it takes {ACCEPTED_FORMS}")  # fmt: skip
    builder = _one_builder(shards, where)
    from datasets.data_files import get_data_patterns

    try:  # datasets' own split inference from the file names (train-*, data/test.jsonl, ...)
        splits = [str(s) for s in get_data_patterns(os.path.abspath(folder))]
    except Exception:  # noqa: BLE001 - anything it cannot infer is one split named train, as datasets does
        splits = ["train"]
    split = _pick_split(split, splits, where)
    return Source(entry, folder, "rows", f"a folder of {len(shards)} {builder} shards", tuple(shards), split,
                  "load_dataset", None)  # fmt: skip
