"""Publishing a checkpoint tag whole or not at all, and verifying one before anything is read (collective).

A save builds the whole tag under a fresh temporary name (`<dir>/.<tag>.tmp-<nonce>/`, DeepSpeed's files too);
`publish_tag` then checksums every file in parallel over the ranks (each rank a share), writes `manifest.json`
last, and only then, after a barrier, renames it into place (a re-save of an existing tag replaces it whole) and
moves `latest` (temp file, fsync, rename, fsync of the directory). `verify_checkpoint` checks the manifest (every
file present, with its size and CRC-32, and nothing unlisted) before anything is read; every load goes through it.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..safe_io import (
    MANIFEST,
    describe_files,
    fsync_path,
    list_files,
    published_tags,
    read_manifest,
    swap_in,
    unlisted_files,
    verify_files,
    write_manifest,
)
from .directory import MODEL_DIR, CheckpointError, latest_tag, mark_verified, write_latest


def from_rank0(value: Any) -> Any:
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share(names: Sequence[str]) -> list[str]:
    """This rank's round-robin share of `names` (checksums and reads spread over the ranks)."""
    return list(names[dist.get_rank() :: dist.get_world_size()])


def gather(part: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def shared_checksums(root: str, names: Sequence[str]) -> dict[str, dict[str, object]]:
    """Every file's size and CRC-32 (`describe_files`), spread over the ranks (collective: each rank reads a
    round-robin share once; a rank's failure is raised on every rank)."""
    try:
        part, error = describe_files(root, share(names)), None
    except OSError as e:
        part, error = {}, f"{e.filename or root}: {e.strerror or e}"
    parts = gather((part, error))
    failed = [e for _, e in parts if e]
    if failed:
        raise OSError(failed[0])
    return dict(sorted((k, v) for p, _ in parts for k, v in p.items()))


def check_tag_name(tag: str) -> None:
    if not tag or tag.startswith(".") or os.sep in tag:
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain name such as step300")


@dataclass(frozen=True)
class StagedTag:
    """A tag being written: `<save_dir>/<staging>/`, published as `<save_dir>/<tag>/`. Same on every rank."""

    save_dir: str
    tag: str
    staging: str

    @classmethod
    def begin(cls, save_dir: str, tag: str) -> StagedTag:
        """Collective: one fresh staging name, chosen by rank 0."""
        check_tag_name(tag)
        return cls(save_dir, tag, f".{tag}.tmp-{from_rank0(uuid.uuid4().hex[:8])}")

    @property
    def staged(self) -> str:
        return os.path.join(self.save_dir, self.staging)

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    @property
    def model_dir(self) -> str:
        return os.path.join(self.staged, MODEL_DIR)

    def publish(self) -> str:
        """Every rank's files are written: fsync and checksum them (each rank a share), write the manifest, rename
        the tag into place and move `latest` (rank 0). Collective; returns the tag directory."""
        dist.barrier()
        staged, final, save_dir = self.staged, self.final, self.save_dir
        # a re-save replaces the tag whole: only a checkpoint (set-up refuses a --save holding anything else of a
        # tag's name, `directory.not_ours`; this is for one made during the run)
        if from_rank0(
            os.path.lexists(final) and self.tag not in published_tags(save_dir)
            if dist.get_rank() == 0
            else None
        ):
            if dist.get_rank() == 0:
                shutil.rmtree(staged)  # this save's own files
            raise CheckpointError(f"{final} exists and is not a checkpoint (no {MANIFEST}); the save of {self.tag} "
                                  "would replace it, so it stopped and left it as it is")  # fmt: skip
        names = from_rank0(list_files(staged) if dist.get_rank() == 0 else None)
        mine = share(names)
        for name in mine:
            fsync_path(os.path.join(staged, name))
        entries = {k: v for part in gather(describe_files(staged, mine)) for k, v in part.items()}
        if dist.get_rank() == 0:
            write_manifest(staged, entries)
            for directory in {os.path.dirname(os.path.join(staged, n)) for n in names} | {staged}:
                fsync_path(directory)
            old = None
            if os.path.lexists(final):  # a re-save of this tag: the new one replaces it whole, in one step
                old = swap_in(staged, final)
            else:
                os.replace(staged, final)
            fsync_path(save_dir)
            if old is not None and os.path.islink(old):
                os.unlink(old)  # a tag that was a link: the link goes, what it pointed at stays
            elif old is not None:
                shutil.rmtree(old)
            write_latest(save_dir, self.tag)
        dist.barrier()
        return final


def verify_checkpoint(load_dir: str, tag: str | None = None) -> str:
    """Check `<load_dir>/<tag or latest>` against its manifest before anything is read (collective: each rank
    checksums a share); returns the tag. A `CheckpointError` names every problem."""
    tag = tag or latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    problems: list[str] = []
    manifest: dict = {}
    if dist.get_rank() == 0:
        if not os.path.isdir(tag_dir):
            left = glob.glob(os.path.join(load_dir, f".{tag}.tmp-*.old"))
            hint = (
                f" (a save was interrupted while replacing it; the previous version is {left[0]})"
                if left
                else ""
            )
            problems.append(f"{tag_dir} does not exist{hint}")
        else:
            try:
                manifest = read_manifest(tag_dir)
                problems += [f"{n} is not in the manifest" for n in unlisted_files(tag_dir, manifest)]
            except ValueError as e:
                problems.append(str(e))
    manifest = from_rank0(manifest if not problems else None) or {}
    if manifest:
        problems += [
            p for part in gather(verify_files(tag_dir, manifest, share(sorted(manifest)))) for p in part
        ]
    problems = from_rank0(problems)  # rank 0's list holds every rank's findings
    if problems:
        shown = "; ".join(problems[:10]) + (
            f"; ... ({len(problems) - 10} more)" if len(problems) > 10 else ""
        )
        raise CheckpointError(f"checkpoint {tag_dir} is damaged or incomplete: {shown}")
    mark_verified(tag_dir)  # its readers in this process skip the per-file check
    return tag
