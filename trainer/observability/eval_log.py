"""The trainer's record of online evaluation: ``eval.result`` messages -> metrics.jsonl and
Prometheus.

The packer publishes one :class:`bus.messages.EvalResult` per eval task and round on the control
channel (:mod:`packer.evaluation`). :class:`EvalLog` drains the trainer's control subscriber,
appends each new result to ``metrics.jsonl`` as ``{"step": round, "eval/<task>/<metric>": value,
...}`` (besides the metrics: ``num_samples``, ``num_failed``, ``version_min``, ``version_max``) and
sets the ``rlbus_eval_*{task}`` gauges. A (round, task) is written once: repeats (a re-published
round, or a round already in metrics.jsonl before a resume) are ignored.

Resume: a checkpoint at step ``n`` keeps the records with ``step <= n``
(:func:`keep_metrics_record`): training records ``{"step": s + 1}`` of the steps it covers, and
after ``busctl up --resume`` the eval records of rounds ``<= n``, which evaluated weights of the
surviving lineage (the resumed trainer republishes version ``n`` bit-identical); rounds ``> n``
evaluated the lost lineage and are dropped (the prompt source and the packer forget them too, and
they are evaluated again when the policy reaches them). A trainer restarted by the supervisor
keeps every eval record: the run goes on (the packer sends the same steps again from its spool),
nothing re-runs those rounds, and the packer publishes its stored results again when it sees the
trainer's version go back, so a result published while the trainer was down is not lost.

Policy version of a round: ``version_min``/``version_max`` are the versions that actually sampled
the round; they exceed the round when the producers were already ahead or a restart made the
prompt source issue the round again (:mod:`prompts.eval_rounds`); the log line then names them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from bus.messages import EvalResult, WeightsWanted
from bus.sockets import BusSocket
from tasks.registry import eval_tasks
from trainer.state.step_ledger import append_jsonl

if TYPE_CHECKING:
    from configs.schema import RunConfig

log = logging.getLogger(__name__)

__all__ = ["EvalLog", "declare_pass_at_k", "eval_record", "keep_metrics_record"]

EVAL_PREFIX = "eval/"

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
EVAL_REWARD_TERM = Gauge("rlbus_eval_reward_term_mean", "Mean score of one reward function in the last eval round", ["task", "reward"])


def declare_pass_at_k(cfg: RunConfig) -> None:
    """Create (at 0) the ``rlbus_eval_pass_at_k{task, k}`` series the run's eval tasks will set,
    so dashboards see them from the first scrape, not from the first eval round.

    One series per eval task (:func:`tasks.registry.eval_tasks`: ``eval.tasks``, or the training
    task when that list is empty) with ``k = rollouts_per_example``, the group size the packer
    reports ``pass_at_<k>`` for (:func:`packer.evaluation.eval_metrics`). None when evaluation is off.
    """
    for task in eval_tasks(cfg):
        EVAL_PASS_AT_K.labels(task=task.name, k=str(task.rollouts_per_example))


def eval_record(result: EvalResult) -> dict:
    """The metrics.jsonl record of one result: ``{"step": round, "eval/<task>/<key>": value}``."""
    prefix = f"{EVAL_PREFIX}{result.task}/"
    record: dict = {"step": result.round}
    for key in ("num_samples", "num_failed", "version_min", "version_max"):
        record[prefix + key] = getattr(result, key)
    record.update({prefix + key: float(value) for key, value in result.metrics.items()})
    return record


def record_evals(record: dict) -> set[tuple[int, str]]:
    """The (round, task) pairs an eval record of metrics.jsonl holds (none for a training record)."""
    return {(record["step"], key[len(EVAL_PREFIX):].split("/", 1)[0]) for key in record if key.startswith(EVAL_PREFIX)}


def keep_metrics_record(record: dict, start_step: int, *, resume: bool = True) -> bool:
    """Whether a metrics.jsonl record survives a restart from checkpoint step ``start_step``:
    ``step <= start_step``, except that eval records all survive a supervisor restart
    (``resume=False``; see the module docstring)."""
    return record["step"] <= start_step or (not resume and bool(record_evals(record)))


class EvalLog:
    """Writes the eval results arriving on a control subscriber (see the module docstring).

    Args:
        control: the trainer's control-channel SUB socket (every message type; others are ignored).
        metrics_path: the run's metrics.jsonl (read once for the results already written).
    """

    def __init__(self, control: BusSocket, metrics_path: Path) -> None:
        self.control = control
        self.metrics_path = metrics_path
        self.written: set[tuple[int, str]] = set()
        if metrics_path.is_file():
            for line in metrics_path.read_text().splitlines():
                if line.strip():
                    self.written |= record_evals(json.loads(line))

    def record(self, result: EvalResult) -> bool:
        """Write ``result`` unless its (round, task) is already written; returns whether it was."""
        key = (result.round, result.task)
        if key in self.written:
            return False
        self.written.add(key)
        append_jsonl(self.metrics_path, eval_record(result))
        values = {**result.metrics, "round": result.round, "num_failed": result.num_failed}
        for name, gauge in EVAL_GAUGES.items():
            if name in values:
                gauge.labels(task=result.task).set(values[name])
        for key, value in result.metrics.items():
            if key.startswith("pass_at_"):
                EVAL_PASS_AT_K.labels(task=result.task, k=key[len("pass_at_"):]).set(value)
            elif key.startswith("reward/"):
                EVAL_REWARD_TERM.labels(task=result.task, reward=key[len("reward/"):]).set(value)
        rerun = (f"; sampled under policy versions {result.version_min}..{result.version_max}, not only {result.round}"
                 if result.version_max > result.round else "")
        log.info("eval round %d, %s: %s (%d samples, %d failed groups%s)", result.round, result.task,
                 {k: round(v, 4) for k, v in result.metrics.items()}, result.num_samples, result.num_failed, rerun)
        return True

    on_weights_wanted: Callable[[WeightsWanted], None] | None = None
    """Called with every ``weights.wanted`` read here (the trainer re-publishes weights through the
    filesystem for a late-joining producer); None: ignored."""

    def poll(self, timeout_s: float = 0.0) -> None:
        """Record every eval result waiting on the control socket and hand ``weights.wanted`` to
        :attr:`on_weights_wanted` (waits up to ``timeout_s`` for the first message)."""
        msg = self.control.recv(timeout_s=timeout_s)
        while msg is not None:
            if isinstance(msg, EvalResult):
                self.record(msg)
            elif isinstance(msg, WeightsWanted) and self.on_weights_wanted is not None:
                self.on_weights_wanted(msg)
            msg = self.control.recv(timeout_s=0)

    def wait_for_round(self, round_: int, tasks: list[str], timeout_s: float, stop: threading.Event) -> list[str]:
        """Poll until every task of ``tasks`` has its result of ``round_`` written, ``timeout_s``
        passed, or ``stop`` is set; returns the tasks still missing (logged as a warning)."""
        deadline = time.monotonic() + timeout_s
        missing = [t for t in tasks if (round_, t) not in self.written]
        while missing and time.monotonic() < deadline and not stop.is_set():
            self.poll(timeout_s=min(0.2, max(deadline - time.monotonic(), 0.0)))
            missing = [t for t in tasks if (round_, t) not in self.written]
        if missing:
            log.warning("no eval result of round %d for task(s) %s after %.1f s; ending the run without them",
                        round_, ", ".join(missing), timeout_s)
        return missing
