"""``RUN_DIR/eval.jsonl``: one line per eval task and round, ``{"step": round, "eval/<task>/<metric>": ...}``,
appended by the packer and read by ``busctl report``, ``busctl eval`` and the trackers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from runfiles.jsonl import keep_jsonl_records

if TYPE_CHECKING:
    from bus.messages import EvalResult

__all__ = ["EVAL_FILE", "EVAL_PREFIX", "eval_record", "keep_eval_records", "read_evals", "record_evals"]

EVAL_FILE = "eval.jsonl"
"""The eval records' file name in the run directory."""

EVAL_PREFIX = "eval/"
"""Every metric key of an eval record starts with this."""


def eval_record(result: EvalResult) -> dict:
    """The record of one result (with ``num_samples``, ``num_failed``, ``version_min/max``)."""
    prefix = f"{EVAL_PREFIX}{result.task}/"
    record: dict = {"step": result.round}
    for key in ("num_samples", "num_failed", "version_min", "version_max"):
        record[prefix + key] = getattr(result, key)
    record.update({prefix + key: float(value) for key, value in result.metrics.items()})
    return record


def record_evals(record: dict) -> set[tuple[int, str]]:
    """The ``(round, task)`` pairs an eval record holds (none for any other record)."""
    return {(record["step"], key[len(EVAL_PREFIX) :].split("/", 1)[0]) for key in record if key.startswith(EVAL_PREFIX)}


def read_evals(path: Path) -> set[tuple[int, str]]:
    """The ``(round, task)`` pairs of every whole line of the eval file ``path`` (none if missing)."""
    if not path.is_file():
        return set()
    lines = path.read_text().split("\n")[:-1]  # a last line without its newline was cut short
    return {pair for line in lines if line.strip() for pair in record_evals(json.loads(line))}


def keep_eval_records(path: Path, last_round: int | None = None) -> int:
    """Atomically drop the records of rounds ``> last_round`` (None: none) and a last line cut short; how many went."""
    return keep_jsonl_records(path, lambda record: last_round is None or record["step"] <= last_round)
