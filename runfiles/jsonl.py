"""JSON-lines files of a run directory (metrics.jsonl, trained_samples.jsonl, eval.jsonl): append a record,
cut a file back to the records a resumed run keeps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runfiles.durable import write_text_atomic

__all__ = ["append_jsonl", "keep_jsonl_records"]


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line to ``path``; non-finite floats (a skipped step's loss)
    become ``null`` so the file stays strict JSON."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean, allow_nan=False) + "\n")


def keep_jsonl_records(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite ``path`` atomically with the records ``keep`` accepts; a last line without its newline (a
    writer killed mid-append) goes too. Returns how many lines went (0: file untouched, or missing).

    Raises ValueError if an earlier line is not a JSON object.
    """
    if not path.is_file():
        return 0
    *lines, tail = path.read_text().split("\n")
    kept, dropped = [], int(bool(tail.strip()))
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n + 1} is not JSON: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n + 1} is not a JSON object")
        if keep(record):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped
