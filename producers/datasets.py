"""Local dataset files: JSONL or Parquet rows into plain dicts, with a field mapping.

A file task (``gsm8k``, or a user's data given in ``task.dataset``) reads its examples from one
local file per split. :func:`load_records` reads it and renames the dataset's columns to the
task's field names, e.g. ``fields={"question": "problem"}`` reads column ``problem`` as the task's
``question``. Only the fields the task asks for are kept.

Invariants:

* **Local files only.** A path with a URL scheme (``hf://``, ``s3://``, ``https://``) is refused,
  and Parquet files are opened with :func:`open` before pyarrow sees them, so nothing is ever
  fetched from a hub or a remote filesystem.
* **Errors name the place.** A missing file, an unknown suffix, a line that is not a JSON object,
  or a row without a required field raises ``ValueError`` with the file, the line (JSONL, 1-based)
  or row (Parquet, 1-based), and the field and the column it maps to.
* pyarrow is imported only when a Parquet file is read (~0.15 s).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FORMATS = ("auto", "jsonl", "parquet")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def resolve_format(path: str | Path, format: str = "auto") -> str:
    """``"jsonl"`` or ``"parquet"``: ``format`` itself, or for ``"auto"`` the one of the suffix
    (``.jsonl``/``.json`` -> jsonl, ``.parquet`` -> parquet).

    Raises:
        ValueError: ``format`` is not one of ``FORMATS``, or ``"auto"`` meets another suffix.
    """
    if format not in FORMATS:
        raise ValueError(f"dataset format={format!r} is unknown; use one of {', '.join(FORMATS)}")
    if format != "auto":
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise ValueError(
            f"dataset file {path}: cannot tell the format from the suffix {suffix!r}; "
            f"use {', '.join(SUFFIX_FORMATS)} or set task.dataset.format"
        )
    return SUFFIX_FORMATS[suffix]


def load_records(
    path: str | Path,
    required: Sequence[str],
    *,
    fields: Mapping[str, str] | None = None,
    format: str = "auto",
) -> list[dict[str, Any]]:
    """Read every row of a local JSONL or Parquet file, keeping the task's ``required`` fields.

    Args:
        path: a local file, relative to the working directory or absolute.
        required: the task's field names each row must have (a value that is JSON ``null`` counts
            as missing).
        fields: ``{task field: dataset column}``; a field not in it is read from the column of the
            same name. Keys that are not in ``required`` are an error (a typo would be silent).
        format: ``"auto"`` (by suffix), ``"jsonl"`` (one JSON object per line, blank lines
            skipped) or ``"parquet"``.

    Returns:
        One ``{field: value}`` dict per row, in file order, with exactly the ``required`` keys.

    Raises:
        ValueError: the path is a URL or does not exist, the format is unknown, ``fields`` names a
            field the task does not use, the file has no rows, a JSONL line is not a JSON object,
            or a row lacks a field (naming the file, the line or row, the field and its column).
    """
    if "://" in str(path):  # before Path(), which folds "//" into "/"
        raise ValueError(f"dataset path {str(path)!r} is a URL; only local files are read (nothing is fetched from a hub)")
    path = Path(path)
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(required))
    if unknown:
        raise ValueError(
            f"dataset fields mapping names {', '.join(map(repr, unknown))}, which the task does not use; "
            f"its fields are {', '.join(map(repr, required))}"
        )
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist (relative paths start at {Path.cwd()})")
    columns = {name: fields.get(name, name) for name in required}
    if resolve_format(path, format) == "jsonl":
        records = _read_jsonl(path, columns)
    else:
        records = _read_parquet(path, columns)
    if not records:
        raise ValueError(f"dataset file {path} has no rows")
    return records


def _pick(row: Mapping[str, Any], columns: Mapping[str, str], where: str) -> dict[str, Any]:
    """The task's fields of one row; ``where`` (``"file:line 3"``) names it in the error."""
    out = {}
    for name, column in columns.items():
        value = row.get(column)
        if value is None:
            via = "" if column == name else f" (mapped from column {column!r})"
            raise ValueError(f"{where}: missing field {name!r}{via}; present: {', '.join(map(repr, row))}")
        out[name] = value
    return out


def _read_jsonl(path: Path, columns: Mapping[str, str]) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:line {line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:line {line_no}: expected a JSON object, got {type(row).__name__}")
            records.append(_pick(row, columns, f"{path}:line {line_no}"))
    return records


def _read_parquet(path: Path, columns: Mapping[str, str]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    with path.open("rb") as f:  # a file object: pyarrow never resolves a filesystem from the path
        parquet = pq.ParquetFile(f)
        present = parquet.schema_arrow.names
        missing = [(name, col) for name, col in columns.items() if col not in present]
        if missing:
            name, col = missing[0]
            via = "" if col == name else f" (mapped from column {col!r})"
            raise ValueError(f"{path}: missing field {name!r}{via} in every row; columns: {', '.join(map(repr, present))}")
        rows = parquet.read(columns=sorted(set(columns.values()))).to_pylist()
    return [_pick(row, columns, f"{path}:row {i}") for i, row in enumerate(rows, start=1)]
