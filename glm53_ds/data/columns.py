"""The columns of a row source: which shape its rows have, under which names.

Shapes, detected from a source's column names in this order (TRL's vocabulary; `training/packing.py` renders each):
  - `messages`: a list of {role, content} turns (OpenAI style, tool turns and tool calls kept);
  - `conversations`: ShareGPT's list of {from, value} turns;
  - `instruction` + `output` (+ `input`, `system`): Alpaca;
  - `prompt` + `completion`;
  - `text`: a document, every token a target (pretraining, or `--pack`).
Other names are declared with `--data-columns ROLE=COLUMN` (every source that has COLUMN) or
`SOURCE:ROLE=COLUMN` (that `--data` entry only), e.g. `messages=dialog`; the line a run prints says what was found.

A row read by `datasets` comes from an Arrow table, where every struct has every field of any row: a field that
is null in a struct (a tool call without `name`, a message without `tool_calls`) is taken as absent, as it was in
the JSON the table was made from (`drop_nulls`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "system",
    "prompt",
    "completion",
    "text",
)
SHAPES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("messages", ("messages",), "chat rows, 'messages' (role/content turns)"),
    ("conversations", ("conversations",), "chat rows, ShareGPT 'conversations' (from/value turns)"),
    ("alpaca", ("instruction", "output"), "chat rows, Alpaca 'instruction' + 'output'"),
    ("prompt-completion", ("prompt", "completion"), "chat rows, 'prompt' + 'completion'"),
    ("text", ("text",), "text rows, 'text' (documents, every token a target)"),
)
STRING_ROLES = ("instruction", "input", "output", "system", "prompt", "completion", "text")


@dataclass(frozen=True)
class ColumnMap:
    """`--data-columns`: role -> column, for every source (`everywhere`) or per source entry (`per_source`)."""

    everywhere: tuple[tuple[str, str], ...] = ()
    per_source: tuple[tuple[str, str, str], ...] = ()  # (source path as given, role, column)

    def for_source(self, path: str, columns: Sequence[str]) -> dict[str, str]:
        """role -> column for the source `path` with `columns`: its own entries, then the global ones whose column
        it has (a global one it lacks does not apply to it)."""
        mapping = {role: column for source, role, column in self.per_source if source == path}
        for role, column in self.everywhere:
            if role not in mapping and column in columns:
                mapping[role] = column
        return mapping


def parse_column_map(
    entries: Sequence[str], sources: Sequence[str], option: str = "--data-columns"
) -> ColumnMap:
    """`ROLE=COLUMN` / `SOURCE:ROLE=COLUMN` entries; a ValueError names the entry (an unknown role, a source that
    is not one of `sources`, a role given twice)."""
    everywhere: list[tuple[str, str]] = []
    per_source: list[tuple[str, str, str]] = []
    for entry in entries:
        left, sep, column = entry.rpartition("=")
        source, colon, role = left.rpartition(":")
        if not sep or not column or not role:
            raise ValueError(
                f"{option} {entry!r}: give ROLE=COLUMN or SOURCE:ROLE=COLUMN (e.g. messages=dialog)"
            )
        if role not in ROLES:
            raise ValueError(f"{option} {entry!r}: {role!r} is not a role; roles: {', '.join(ROLES)}")
        if colon:
            if source not in sources:
                raise ValueError(f"{option} {entry!r}: {source!r} is not one of the --data sources "
                                 f"({', '.join(map(repr, sources))})")  # fmt: skip
            if any(s == source and r == role for s, r, _ in per_source):
                raise ValueError(f"{option} {entry!r}: {role!r} of {source!r} is mapped twice")
            per_source.append((source, role, column))
        else:
            if any(r == role for r, _ in everywhere):
                raise ValueError(f"{option} {entry!r}: {role!r} is mapped twice")
            everywhere.append((role, column))
    return ColumnMap(tuple(everywhere), tuple(per_source))


def detect_shape(columns: Sequence[str], mapping: Mapping[str, str], where: str) -> str:
    """The shape (`SHAPES`) of rows with `columns` read through `mapping` (role -> column); a ValueError naming
    `where`, the columns and `--data-columns` when none fits or a mapped column is missing."""
    for role, column in mapping.items():
        if column not in columns:
            raise ValueError(f"{where}: --data-columns {role}={column}: no column {column!r}; its columns: "
                             f"{', '.join(map(repr, columns))}")  # fmt: skip
    named = set(columns) - set(mapping.values()) | set(mapping)  # roles available after the mapping
    for shape, needs, _ in SHAPES:
        if all(role in named for role in needs):
            return shape
    raise ValueError(f"{where}: its columns ({', '.join(map(repr, columns))}) hold none of the shapes read "
                     "('messages'; 'conversations'; 'instruction' + 'output'; 'prompt' + 'completion'; 'text'); name "
                     "yours with --data-columns ROLE=COLUMN, e.g. messages=dialog")  # fmt: skip


def describe(shape: str, mapping: Mapping[str, str]) -> str:
    words = next(text for name, _, text in SHAPES if name == shape)
    if mapping:
        words += " from " + ", ".join(f"column {c!r} as {r!r}" for r, c in sorted(mapping.items()))
    return words


def is_chat(shape: str) -> bool:
    return shape != "text"


def check_types(features: Mapping[str, Any], shape: str, mapping: Mapping[str, str], where: str) -> None:
    """Before any row is read: the Arrow types of the columns the shape reads (`features`: datasets' Features).
    A ValueError names `where` and the column."""
    role_column = {role: mapping.get(role, role) for role in ROLES}
    needs = next(n for name, n, _ in SHAPES if name == shape)
    read = list(needs) + [r for r in ("input", "system") if shape == "alpaca" and role_column[r] in features]
    for role in read:
        column = role_column[role]
        feature = features.get(column)
        if feature is None:
            continue
        kind = _feature_kind(feature)
        wanted = "list" if role in ("messages", "conversations") else "string"
        if kind != wanted:
            raise ValueError(f"{where}: column {column!r} ({role}) is {_feature_name(feature)}, not "
                             f"{'a list of turns' if wanted == 'list' else 'text'}")  # fmt: skip


def _feature_kind(feature: Any) -> str:
    name = type(feature).__name__
    if name in ("List", "LargeList", "Sequence") or isinstance(feature, list):
        return "list"
    if name == "Value" and getattr(feature, "dtype", "") in ("string", "large_string"):
        return "string"
    return name


def _feature_name(feature: Any) -> str:
    if type(feature).__name__ == "Value":
        return str(feature.dtype)
    return type(feature).__name__


def drop_nulls(value: Any) -> Any:
    """`value` with every null field of a dict left out, recursively (module docstring)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def record(row: Mapping[str, Any], shape: str, mapping: Mapping[str, str], where: str) -> Any:
    """A row as the record `packing.chat_messages` reads (roles as keys), or a text row's document. A null where
    the shape needs a value is a ValueError naming `where` and the column."""
    if shape == "text":
        column = mapping.get("text", "text")
        text = row.get(column)
        if not isinstance(text, str):
            raise ValueError(f"{where}: column {column!r} must be text, got "
                             f"{'null' if text is None else type(text).__name__}")  # fmt: skip
        return text
    out: dict[str, Any] = {}
    for role in ROLES:
        column = mapping.get(role, role)
        if column in row and row[column] is not None:
            out[role] = drop_nulls(row[column])
    if not any(all(role in out for role in needs) for name, needs, _ in SHAPES if name != "text"):
        # no chat shape in this row (a .jsonl row may have its own shape): a null where the source's shape reads
        # is named; otherwise `chat_messages` says which shapes a row may have
        nulls = [
            mapping.get(r, r)
            for r in next(n for name, n, _ in SHAPES if name == shape)
            if mapping.get(r, r) in row
        ]
        if nulls:
            raise ValueError(f"{where}: column {nulls[0]!r} is null")
    return out
