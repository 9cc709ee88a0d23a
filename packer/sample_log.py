"""Examples of what the policy learns from: the first ``report.samples_per_step`` samples of every
``report.samples_interval``-th step (step 0, the base policy, always), in group order, appended to
``RUN_DIR/samples.jsonl``, one JSON object per line (:func:`sample_records`); with a multiple of the
group size the file holds whole groups, winners and losers side by side. ``step`` is the 0-based
step that trains the sample (its ``metrics.jsonl`` record has ``step + 1``), ``lag = step -
policy_version``, ``version_spans`` the completion's ``[version, num_tokens]`` runs. A step is one
whole write; an I/O error is logged and counted, never raised. After a resume a step may appear
twice (readers keep the last).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from prometheus_client import Counter

from bus.messages import ScoredGroup
from bus.sample_arrays import run_lengths, sample_token_versions

log = logging.getLogger(__name__)

__all__ = ["SamplesLog", "sample_records"]

SAMPLES_LOG_ERRORS = Counter(
    "rlbus_packer_samples_log_errors_total", "Steps whose examples could not be appended to samples.jsonl (I/O error)"
)


def sample_records(step: int, groups: list[ScoredGroup], limit: int, now: float | None = None) -> list[dict]:
    """The ``samples.jsonl`` records of 0-based step ``step``: the first ``limit`` samples of ``groups``
    (its training groups, in packing order), plain JSON types; ``now``: the ``time`` field (unix s)."""
    now = time.time() if now is None else now
    records: list[dict] = []
    for group in groups:
        for j in range(group.group_size):
            if len(records) >= limit:
                return records
            version = int(group.version_start[j])
            records.append(
                {
                    "step": int(step),
                    "time": round(float(now), 3),
                    "group_id": group.id,
                    "task": group.task,
                    "sample": j,
                    "group_size": group.group_size,
                    "prompt": group.prompt_text,
                    "completion": group.completion_texts[j],
                    "reward": float(group.rewards[j]),
                    "advantage": float(group.advantages[j]),
                    "reward_terms": {str(name): float(scores[j]) for name, scores in group.reward_terms.items()},
                    "policy_version": version,
                    "lag": int(step) - version,
                    "version_spans": run_lengths(sample_token_versions(group, j)).tolist(),
                    "finish_reason": group.finish_reasons[j],
                    "completion_tokens": int(group.completion_lens[j]),
                    "masked": bool(len(group.masked) and group.masked[j]),
                    "producer": group.producer,
                }
            )
    return records


class SamplesLog:
    """Appends the examples of the steps with ``step % interval == 0`` (``interval`` 0: none), at most
    ``per_step`` each, to ``path``. ValueError for ``interval < 0`` or ``per_step < 1``."""

    def __init__(self, path: Path, interval: int, per_step: int) -> None:
        if interval < 0 or per_step < 1:
            raise ValueError(
                f"need interval >= 0 and per_step >= 1, got {interval} and {per_step}; see report.* in the config"
            )
        self.path = Path(path)
        self.interval = interval
        self.per_step = per_step
        self.errors = 0
        """Steps whose examples were lost to an I/O error."""

    def due(self, step: int) -> bool:
        """Whether step ``step`` is sampled."""
        return self.interval > 0 and step % self.interval == 0

    def write(self, step: int, groups: list[ScoredGroup]) -> int:
        """Append the examples of step ``step`` (its training groups in packing order) if due; returns the
        lines written (0 when not due, no groups, or on an I/O error, logged and counted)."""
        if not self.due(step):
            return 0
        records = sample_records(step, groups, self.per_step)
        if not records:
            return 0
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:  # a full disk or a vanished run dir must not stop training
            self.errors += 1
            SAMPLES_LOG_ERRORS.inc()
            log.error("could not append step %d's examples to %s: %s", step, self.path, exc)
            return 0
        return len(records)
