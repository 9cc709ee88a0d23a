"""Examples of what the policy is learning from: a few samples of every N-th step appended to
``RUN_DIR/samples.jsonl`` (``report.samples_interval``, ``report.samples_per_step``).

The packer calls :meth:`SamplesLog.write` once per emitted optimizer step, after the step's
micro-batches went out. A step ``s`` is sampled when ``samples_interval > 0`` and
``s % samples_interval == 0`` (so step 0, the base policy, is always in the file); its first
``samples_per_step`` samples are written, in the step's group order and, within a group, by
sample index: with ``samples_per_step`` a multiple of the group size the file holds whole groups,
so the completions that won and lost within a group can be read side by side (their
group-relative advantages then sum to ~0).

One JSON object per line (:func:`sample_records`)::

    {"step": 0, "time": 1732190000.1, "group_id": "p000000-...", "task": "reverse_text",
     "sample": 0, "group_size": 4, "prompt": "<chat-templated prompt>", "completion": "...",
     "reward": 0.43, "advantage": 0.12, "reward_terms": {"lcs": 0.43}, "policy_version": 0,
     "lag": 0, "version_spans": [[0, 9]], "finish_reason": "stop", "completion_tokens": 9,
     "masked": false, "producer": "producer-0"}

``step`` is the 0-based index of the optimizer step that trains the sample (as in
``trained_samples.jsonl``; the trainer's ``metrics.jsonl`` record of that step has ``step + 1``);
``lag`` = ``step - policy_version`` (the sample's oldest policy version); ``version_spans`` the
``[version, num_tokens]`` runs of its completion tokens (several for a partial rollout; from the
group's spans, or one run at ``policy_version`` when the producer sent none). ``prompt`` is the
producer's chat-templated prompt text (``RolloutGroup.prompt_text``; ``""`` from a sender that
does not fill it). Eval groups never reach this file (they are not trained).

Invariants: every line is a whole JSON object (one ``write`` of the full text, flushed and closed
per step); an I/O error never stops the packer: it is logged and counted in
``rlbus_packer_samples_log_errors_total``, and the step's examples are lost. After
``busctl up --resume`` a step may appear twice (the packer re-emits it); readers keep the last.
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
    """The ``samples.jsonl`` records of step ``step``: its first ``limit`` samples.

    Args:
        step: 0-based optimizer step the groups are trained in.
        groups: the step's groups, in packing order (training groups, each ``G`` samples).
        limit: most records (>= 0).
        now: the ``time`` field, unix seconds (default: now).

    Returns:
        Up to ``limit`` dicts with the fields of the module docstring, plain JSON types only.
    """
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
    """Appends examples of every ``interval``-th step to ``path`` (see the module docstring).

    Args:
        path: the run's ``samples.jsonl`` (created on the first write; its directory must exist).
        interval: sample steps with ``step % interval == 0``; 0 disables the log.
        per_step: most examples per sampled step (>= 1).

    Raises:
        ValueError: ``interval < 0`` or ``per_step < 1``.
    """

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
        """Whether step ``step`` is sampled: ``interval > 0 and step % interval == 0``."""
        return self.interval > 0 and step % self.interval == 0

    def write(self, step: int, groups: list[ScoredGroup]) -> int:
        """Append the examples of step ``step`` if it is due; never raises on an I/O error.

        Args:
            step: 0-based optimizer step. groups: its training groups, in packing order.

        Returns:
            Lines written (0 when not due, no groups, or on an I/O error, which is logged and
            counted).
        """
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
