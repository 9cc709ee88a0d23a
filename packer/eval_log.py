"""The packer's record of online evaluation: each closed round's results appended to
``RUN_DIR/eval.jsonl`` (:mod:`runfiles.eval_records`) once per (round, task), and the
``rlbus_eval_*{task}`` gauges. Resume rules: docs/ARCHITECTURE.md ("Online evaluation").
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from bus.messages import EvalResult
from runfiles.eval_records import eval_record, keep_eval_records, read_evals
from tasks.registry import eval_tasks

if TYPE_CHECKING:
    from configs.schema import RunConfig

log = logging.getLogger(__name__)

__all__ = ["EvalLog", "declare_pass_at_k"]

EVAL_GAUGES = {
    key: Gauge(f"rlbus_eval_{key}", doc, ["task"])
    for key, doc in {
        "reward_mean": "Mean reward of the last eval round, per eval task",
        "reward_std": "Std of the rewards of the last eval round, per eval task",
        "completion_len_mean": "Mean completion length of the last eval round, per eval task, tokens",
        "round": "Policy version evaluated by the last eval round, per eval task",
        "num_failed": "Eval groups whose generation failed in the last eval round, per eval task",
    }.items()
}
EVAL_PASS_AT_K = Gauge("rlbus_eval_pass_at_k", "pass@k of the last eval round, per eval task", ["task", "k"])
EVAL_REWARD_TERM = Gauge(
    "rlbus_eval_reward_term_mean", "Mean score of one reward function in the last eval round", ["task", "reward"]
)


def declare_pass_at_k(cfg: RunConfig) -> None:
    """Create (at 0) the ``rlbus_eval_pass_at_k{task, k}`` series of ``cfg``'s eval tasks
    (``k = rollouts_per_example``), so dashboards have them before the first round."""
    for task in eval_tasks(cfg):
        EVAL_PASS_AT_K.labels(task=task.name, k=str(task.rollouts_per_example))


class EvalLog:
    """Appends eval results to ``path`` (``eval.jsonl``), each (round, task) once; ``keep_through``: after
    ``busctl up --resume`` from checkpoint step ``n``, the records of rounds ``> n`` go first (None:
    all kept). A last line cut short goes either way."""

    def __init__(self, path: Path, keep_through: int | None = None) -> None:
        self.path = Path(path)
        gone = keep_eval_records(self.path, keep_through)
        if gone:
            log.info("dropped %d eval record(s) of rounds after the checkpoint (or cut short) from %s", gone, path)
        self.written = read_evals(self.path)  # (round, task) pairs in the file

    def write(self, result: EvalResult) -> bool:
        """Append ``result`` and set the gauges unless its (round, task) is written; whether it was.
        OSError if the file cannot be written (the pair then counts as not written)."""
        key = (result.round, result.task)
        if key in self.written:
            return False
        with self.path.open("a") as f:
            f.write(json.dumps(eval_record(result)) + "\n")
        self.written.add(key)
        values = {**result.metrics, "round": result.round, "num_failed": result.num_failed}
        for name, gauge in EVAL_GAUGES.items():
            if name in values:
                gauge.labels(task=result.task).set(values[name])
        for name, value in result.metrics.items():
            if name.startswith("pass_at_"):
                EVAL_PASS_AT_K.labels(task=result.task, k=name[len("pass_at_") :]).set(value)
            elif name.startswith("reward/"):
                EVAL_REWARD_TERM.labels(task=result.task, reward=name[len("reward/") :]).set(value)
        return True
