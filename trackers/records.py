"""What the trackers log, read from the run's JSONL files: pure functions over their records.

``metrics.jsonl`` (the trainer's step records) and ``eval.jsonl`` (the packer's eval records
``{"step": round, "eval/<task>/<metric>": ...}``, :mod:`runfiles.eval_records`): :func:`split_metrics_record`;
``stages.jsonl`` (per step, each component's throughput, busy fraction and queue
depth: :func:`stage_scalars`) and ``samples.jsonl`` (the packer's examples: :func:`sample_row`), each read by
:class:`JsonlTail`. Every record goes at its own ``step``: training and stage records at steps done, eval
records at their round, sample tables at the sampled step's 0-based index (the policy version it started from).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from runfiles.eval_records import EVAL_PREFIX

__all__ = [
    "EVAL_PREFIX",
    "SAMPLE_COLUMNS",
    "JsonlTail",
    "flatten_config",
    "sample_row",
    "split_metrics_record",
    "stage_scalars",
]


SAMPLE_COLUMNS = (
    "step",
    "task",
    "group_id",
    "sample",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "policy_version",
    "lag",
    "finish_reason",
    "completion_tokens",
)
"""The columns of a samples table, in order (fields of a ``samples.jsonl`` record)."""

STAGE_FIELDS = {
    ("throughput", "samples_per_s"): "samples_per_s",
    ("throughput", "tokens_per_s"): "tokens_per_s",
    ("busy",): "busy",
    ("queue_depth",): "queue_depth",
}
"""Path in a component's ``stages.jsonl`` entry -> the last part of its scalar's name."""


class JsonlTail:
    """Reads the whole lines appended to a JSONL file since the last read, from a byte ``offset``.

    A line still being written waits for the next read; a line that is not a JSON object is counted in
    :attr:`malformed` and dropped. A file replaced by a rewrite (another inode, or shorter than the offset: a
    ``--resume`` keeps only the records its checkpoint covers) is read again from byte 0, skipping the lines already
    returned (those before ``offset`` count as returned), so only what is new reaches the trackers.

    Raises:
        ValueError: ``offset`` is negative.
    """

    def __init__(self, path: Path, offset: int = 0) -> None:
        if offset < 0:
            raise ValueError(f"JsonlTail offset for {path} must be >= 0, got {offset}")
        self.path = Path(path)
        self.offset = offset
        self.malformed = 0
        self._seen: set[int] = set()
        """hash() of every line returned so far (and of those before ``offset`` at the start)."""
        self._inode: int | None = None
        try:
            self._inode = self.path.stat().st_ino
            with self.path.open("rb") as f:
                self._seen = {hash(line) for line in f.read(offset).splitlines(keepends=True)}
        except FileNotFoundError:
            pass

    def read(self) -> list[dict]:
        """The records of the whole lines added since the last read (``[]``: none, or no file); OSError when the file
        exists but cannot be read."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        replaced = st.st_size < self.offset or (self._inode is not None and st.st_ino != self._inode)
        self._inode = st.st_ino
        if replaced:
            self.offset = 0
        if st.st_size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines(keepends=True):
            key = hash(line)
            if (replaced and key in self._seen) or not line.strip():
                continue
            self._seen.add(key)
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                out.append(rec)
            else:
                self.malformed += 1
        return out


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None (bools, strings, None, nan and inf are not scalars)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def split_metrics_record(rec: dict) -> tuple[str, int, dict[str, float]] | None:
    """``(kind, step, scalars)`` of one ``metrics.jsonl`` or ``eval.jsonl`` record, or None without an integer
    ``step >= 0`` or a numeric value. ``kind`` is ``"eval"`` when a key starts with :data:`EVAL_PREFIX` (only those
    keys are scalars), else ``"train"``; non-finite values are left out (trackers reject or mis-plot them)."""
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    is_eval = any(k.startswith(EVAL_PREFIX) for k in rec)
    scalars = {}
    for key, value in rec.items():
        if key == "step" or (is_eval and not key.startswith(EVAL_PREFIX)):
            continue
        number = _number(value)
        if number is not None:
            scalars[key] = number
    if not scalars:
        return None
    return ("eval" if is_eval else "train"), step, scalars


def stage_scalars(rec: dict) -> tuple[int, dict[str, float]] | None:
    """``(step, {"stages/<component>/<field>": value})`` of one ``stages.jsonl`` record (throughput per second, busy
    fraction in [0, 1], queue depth in items; a null field is left out); None without an integer ``step`` or value."""
    step = rec.get("step")
    components = rec.get("components")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(components, dict):
        return None
    out = {}
    for name, stat in components.items():
        if not isinstance(stat, dict):
            continue
        for path, field in STAGE_FIELDS.items():
            value: object = stat
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            number = _number(value)
            if number is not None:
                out[f"stages/{name}/{field}"] = number
    return (step, out) if out else None


def sample_row(rec: dict) -> tuple[int, list] | None:
    """``(step, row)`` of one ``samples.jsonl`` record: the row holds :data:`SAMPLE_COLUMNS` in
    order (a missing field is None; text fields as str). None without an integer ``step``."""
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    row = []
    for col in SAMPLE_COLUMNS:
        value = rec.get(col)
        row.append(
            str(value)
            if col in ("task", "group_id", "prompt", "completion", "finish_reason") and value is not None
            else value
        )
    return step, row


def flatten_config(cfg: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """The resolved config as flat hyperparameters (``{"trainer.optim.lr": 0.0001, ...}``); values other than
    str, int, float and bool become their JSON text (trackers take scalars only)."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, name + "."))
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out
