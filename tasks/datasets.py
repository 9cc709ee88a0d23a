"""Local dataset files (JSONL or Parquet) read into dicts with a field mapping, and file tasks.

Only local files: a path with a URL scheme is refused and Parquet files are opened with
:func:`open` before pyarrow sees them, so nothing is fetched from a hub or remote filesystem.
Errors name the file, the line (JSONL) or row (Parquet, 1-based), the field and its column.
pyarrow is imported only to read Parquet. Every column a task does not read goes into each
example's ``info`` as it is, so reward functions get all columns as TRL passes them. A file
task's ``"train"`` split is its file shuffled by ``seed`` (a fixed permutation), ``"eval"`` the
eval file in order; ids ``"{task}/{split}/{row}"`` name the same problem whatever the seed.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.task import KNOWN_SPLITS, Example, Loader, Task, check_request

if TYPE_CHECKING:
    from configs.rollout import DatasetConfig

FORMATS = ("auto", "jsonl", "parquet")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
DEFAULT_FILES = {"train": "train.jsonl", "eval": "test.jsonl"}  # a file task's shipped files, per split


def resolve_format(path: str | Path, format: str = "auto") -> str:
    """``"jsonl"`` or ``"parquet"``: ``format``, or for ``"auto"`` the suffix's (``SUFFIX_FORMATS``).
    ValueError for an unknown format or suffix."""
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
    """One ``{field: value}`` dict per row, in order: the ``required`` keys (null counts as missing),
    each read from its column (``fields``: ``{task field: column}``, default the same name), then every
    other column under its own name. ValueError for a URL or missing path, an unknown format or field,
    no rows, a non-object line, or a row without a field."""
    if "://" in str(path):  # before Path(), which folds "//" into "/"
        raise ValueError(
            f"dataset path {str(path)!r} is a URL; only local files are read (nothing is fetched from a hub)"
        )
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
    """The task's fields of one row, then its other columns; ``where`` (``"file:line 3"``) names it in errors."""
    mapped = set(columns.values())
    out = {column: value for column, value in row.items() if column not in mapped and column not in columns}
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
            raise ValueError(
                f"{path}: missing field {name!r}{via} in every row; columns: {', '.join(map(repr, present))}"
            )
        rows = parquet.read().to_pylist()
    return [_pick(row, columns, f"{path}:row {i}") for i, row in enumerate(rows, start=1)]


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


Fields = Sequence[str] | Mapping[str, tuple[type, ...]]  # a task's fields, with the types it takes where mapped


@dataclasses.dataclass(frozen=True)
class DataSource:
    """What :mod:`tasks.data_check` checks of a file task before the run: its ``files`` per split, the
    ``required`` fields (with their types where a mapping gives them) and its ``make_example``."""

    task_name: str
    files: Mapping[str, DataFile]
    required: Fields
    make_example: Callable[[dict[str, Any], str], Example]


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One split's local file, its ``fields`` mapping and ``format`` (:func:`load_records`)."""

    path: str | Path
    fields: Mapping[str, str] | None = None
    format: str = "auto"


def file_task_loader(
    task_name: str,
    files: Mapping[str, DataFile],
    *,
    required: Fields,
    make_example: Callable[[dict[str, Any], str], Example],
) -> Loader:
    """``load(split, num_examples, seed)`` over ``files`` (one :class:`DataFile` per split, read on each
    call); ``make_example(record, id) -> example``, its ValueError/TypeError re-raised naming the file
    and record. The record's columns beyond ``required`` join the example's ``info`` (the example's own
    keys win; a value JSON cannot carry, e.g. a Parquet timestamp, is left out). Raises ValueError when
    ``files`` lacks a split."""
    missing = [split for split in KNOWN_SPLITS if split not in files]
    if missing:
        raise ValueError(f"task {task_name!r}: no file for split(s) {', '.join(missing)}")

    def load(split: str, num_examples: int, seed: int) -> list[Example]:
        check_request(split, num_examples)
        file = files[split]
        records = load_records(file.path, required, fields=file.fields, format=file.format)
        order = list(range(len(records)))
        if split == "train":
            random.Random(f"{task_name}/train/{seed}").shuffle(order)
        examples = []
        for k in order[:num_examples]:
            try:
                example = make_example(records[k], f"{task_name}/{split}/{k}")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{file.path}: record {k + 1}: {exc}") from exc
            other = {c: v for c, v in records[k].items() if c not in required and _is_json(v)}
            if other:
                example["info"] = {**other, **example["info"]}
            examples.append(example)
        return examples

    load.data_source = DataSource(task_name, dict(files), required, make_example)  # type: ignore[attr-defined]
    return load


def file_task(
    name: str,
    dataset: DatasetConfig | None,
    default_dir: Path,
    required: Fields,
    make_example: Callable[[dict[str, Any], str], Example],
    **task_fields: Any,
) -> Task:
    """A file task over ``default_dir/{train,test}.jsonl``, or the user's ``dataset`` files where given
    (its ``fields`` and ``format`` apply to those only); ``task_fields`` go to :class:`tasks.task.Task`.
    Raises ValueError for ``dataset.fields`` without ``dataset.path`` or ``eval_path``."""
    if dataset is not None and dataset.fields and not (dataset.path or dataset.eval_path):
        raise ValueError(
            f"task {name!r}: task.dataset.fields is set but neither task.dataset.path nor eval_path; "
            "the mapping applies to your files"
        )
    own = {"train": dataset.path, "eval": dataset.eval_path} if dataset is not None else {}
    mine = {"fields": dataset.fields or None, "format": dataset.format} if dataset is not None else {}
    files = {
        split: DataFile(own[split], **mine) if own.get(split) else DataFile(default_dir / DEFAULT_FILES[split])
        for split in KNOWN_SPLITS
    }
    return Task(name, file_task_loader(name, files, required=required, make_example=make_example), **task_fields)
