"""Dataset files checked before a run starts (``busctl up`` and ``busctl up --dry-run``, :mod:`busctl.preflight`).

Every row a file task (:func:`tasks.datasets.file_task_loader`) would read is streamed once: the JSON of each
line, each field the task needs (present, not null, of its type where the task declares one) and the task's own
``make_example``; the first bad row is a ValueError naming the file, the line (JSONL) or row (Parquet, 1-based)
and the field. Without this the prompt source found it only after every component had started. The check stops
at a time budget (a note says where; the prompt source checks the rest as it loads them), so a large file does
not hold up the start for long.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.datasets import DataSource, _pick, resolve_format
from tasks.task import Task

BUDGET_S = 5.0  # of checking, for all files of a run together (~100k JSONL rows on a slow host)
BATCH_ROWS = 1024  # Parquet rows read at a time


def data_source(task: Task) -> DataSource | None:
    """The files a task reads (:class:`tasks.datasets.DataSource`), or None for a task that reads none."""
    return getattr(task.load, "data_source", None)


def check_task_data(task: Task, splits: Sequence[str], deadline: float) -> tuple[int, str]:
    """Check every row of ``task``'s files of ``splits`` until ``time.monotonic()`` passes ``deadline``.

    Returns:
        ``(rows checked, note)``: the note is ``""``, or says where the check stopped at the deadline.

    Raises:
        ValueError: the first bad row, naming file, line or row, and field; a missing or empty file.
    """
    source = data_source(task)
    if source is None:
        return 0, ""
    rows = 0
    for split in dict.fromkeys(splits):
        file = source.files.get(split)
        if file is None:
            continue
        path = Path(file.path)
        if "://" in str(file.path) or not path.is_file():
            raise ValueError(f"task {source.task_name!r} {split} file {file.path}: no such local file")
        fields = dict(file.fields or {})
        columns = {name: fields.get(name, name) for name in source.required}
        types = source.required if isinstance(source.required, Mapping) else {}
        seen = 0
        for where, row in _rows(path, resolve_format(path, file.format), columns):
            record = _pick(row, columns, where)
            for name, allowed in types.items():
                value = record[name]
                if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                    want = " or ".join(t.__name__ for t in allowed)
                    raise ValueError(
                        f"{where}: field {name!r}{_via(name, columns)} is {type(value).__name__} "
                        f"({json.dumps(value, default=str)[:60]}), expected {want}"
                    )
            try:
                source.make_example(record, f"{source.task_name}/{split}/{seen}")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{where}: {exc}") from None
            seen += 1
            if seen % 256 == 0 and time.monotonic() > deadline:
                return rows + seen, (
                    f"the data check stopped at {where} after its {BUDGET_S:g} s budget ({rows + seen} rows checked); "
                    "the prompt source checks the rest as it loads them"
                )
        if not seen:
            raise ValueError(f"dataset file {path} has no rows")
        rows += seen
    return rows, ""


def _via(name: str, columns: Mapping[str, str]) -> str:
    return "" if columns[name] == name else f" (column {columns[name]!r})"


def _rows(path: Path, fmt: str, columns: Mapping[str, str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of every row, streamed; ValueError for bad JSON, a non-object line, a missing column."""
    if fmt == "jsonl":
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
                yield f"{path}:line {line_no}", row
        return
    import pyarrow.parquet as pq

    with path.open("rb") as f:  # a file object: pyarrow never resolves a filesystem from the path
        parquet = pq.ParquetFile(f)
        present = parquet.schema_arrow.names
        for name, column in columns.items():
            if column not in present:
                raise ValueError(
                    f"{path}: missing field {name!r}{_via(name, columns)} in every row; "
                    f"columns: {', '.join(map(repr, present))}"
                )
        n = 0
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=sorted(set(columns.values()))):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}:row {n}", row
