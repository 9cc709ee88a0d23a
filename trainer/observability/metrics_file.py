"""The run's ``metrics.jsonl`` as the trainer writes it: one writer object shared by two threads.

The trainer's main thread appends one training record per step (``{"step": s + 1, ...}``) and the
eval-log thread (:class:`trainer.observability.eval_log.EvalLog`) appends eval records
(``{"step": round, "eval/<task>/...": ...}``) the moment they arrive, also while a step trains.
Both go through :meth:`MetricsFile.append`, which holds one lock around the whole line write, so
two records never interleave inside a line (a Python ``write`` of a long line may be split into
several system calls). Each line is one strict-JSON object (:func:`trainer.state.step_ledger.append_jsonl`:
non-finite floats become ``null``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from trainer.state.step_ledger import append_jsonl

__all__ = ["MetricsFile"]


class MetricsFile:
    """Thread-safe appender of JSON lines to one file.

    Args:
        path: the file (created on the first append; its folder must exist).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line, atomically with respect to the other threads' appends.

        Raises:
            TypeError: ``record`` is not a dict or holds a value JSON cannot encode.
            OSError: the file cannot be written.
        """
        if not isinstance(record, dict):
            raise TypeError(f"a metrics.jsonl record must be a dict, got {type(record).__name__}")
        with self._lock:
            append_jsonl(self.path, record)
