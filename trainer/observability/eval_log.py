"""The trainer's record of online evaluation: ``eval.result`` messages -> metrics.jsonl and
Prometheus.

The packer publishes one :class:`bus.messages.EvalResult` per eval task and round on the control
channel (:mod:`packer.evaluation`). :class:`EvalLog` drains the trainer's control subscriber,
appends each new result to ``metrics.jsonl`` as ``{"step": round, "eval/<task>/<metric>": value,
...}`` (besides the metrics: ``num_samples``, ``num_failed``, ``version_min``, ``version_max``) and
sets the ``rlbus_eval_*{task}`` gauges. A (round, task) is written once: repeats (a re-published
round, or a round already in metrics.jsonl before a resume) are ignored.

Its own thread. The subscriber is drained by a thread of its own (:meth:`EvalLog.start`), not by
the trainer's wait for micro-batches: when the trainer is the bottleneck (every GPU run) the next
step's data is always buffered and that wait never runs, so results polled only there were written
late or never, and the control messages piling up on the unread SUB (every ``trainer.step``,
``weights.*``, ``groups.trained``...) would, past the socket's 10 000-message high-water mark
(:mod:`bus.topics`, SUB drops), start dropping results. The thread owns the socket from
:meth:`~EvalLog.start` until :meth:`~EvalLog.close`, writes each result the moment it arrives (also
while a step trains) through the :class:`trainer.observability.metrics_file.MetricsFile` the
trainer's step records use (one lock, whole lines), and keeps the SUB empty, so nothing reaches the
high-water mark. A failing write (disk full) is logged and the thread goes on with the next message.

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
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from bus.messages import EvalResult
from bus.sockets import BusSocket
from tasks.registry import eval_tasks
from trainer.observability.metrics_file import MetricsFile

if TYPE_CHECKING:
    from configs.schema import RunConfig

log = logging.getLogger(__name__)

__all__ = ["EvalLog", "declare_pass_at_k", "eval_record", "keep_metrics_record"]

EVAL_PREFIX = "eval/"

RECV_SLICE_S = 0.1
"""Longest wait of the eval-log thread for one control message before checking its stop flag, seconds."""

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
    return {(record["step"], key[len(EVAL_PREFIX) :].split("/", 1)[0]) for key in record if key.startswith(EVAL_PREFIX)}


def keep_metrics_record(record: dict, start_step: int, *, resume: bool = True) -> bool:
    """Whether a metrics.jsonl record survives a restart from checkpoint step ``start_step``:
    ``step <= start_step``, except that eval records all survive a supervisor restart
    (``resume=False``; see the module docstring)."""
    return record["step"] <= start_step or (not resume and bool(record_evals(record)))


class EvalLog:
    """Writes the eval results arriving on a control subscriber (see the module docstring).

    Args:
        control: the trainer's control-channel SUB socket (every message type; others are
            ignored). Once :meth:`start` ran, only the eval-log thread touches it.
        metrics: the run's metrics.jsonl writer, shared with the trainer's step records (read
            once here for the results already written).

    Raises:
        TypeError: ``metrics`` is not a :class:`MetricsFile`.
    """

    def __init__(self, control: BusSocket, metrics: MetricsFile) -> None:
        if not isinstance(metrics, MetricsFile):
            raise TypeError(f"EvalLog needs a MetricsFile for metrics.jsonl, got {type(metrics).__name__}")
        self.control = control
        self.metrics = metrics
        self.written: set[tuple[int, str]] = set()
        """(round, task) pairs in metrics.jsonl; read and changed under :attr:`_changed`'s lock."""
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        path = metrics.path
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    self.written |= record_evals(json.loads(line))

    def record(self, result: EvalResult) -> bool:
        """Write ``result`` unless its (round, task) is already written; returns whether it was.

        Raises:
            OSError: metrics.jsonl cannot be written (the pair then counts as not written).
        """
        key = (result.round, result.task)
        with self._changed:
            if key in self.written:
                return False
            self.metrics.append(eval_record(result))
            self.written.add(key)
            self._changed.notify_all()
        values = {**result.metrics, "round": result.round, "num_failed": result.num_failed}
        for name, gauge in EVAL_GAUGES.items():
            if name in values:
                gauge.labels(task=result.task).set(values[name])
        for key, value in result.metrics.items():
            if key.startswith("pass_at_"):
                EVAL_PASS_AT_K.labels(task=result.task, k=key[len("pass_at_") :]).set(value)
            elif key.startswith("reward/"):
                EVAL_REWARD_TERM.labels(task=result.task, reward=key[len("reward/") :]).set(value)
        rerun = (
            f"; sampled under policy versions {result.version_min}..{result.version_max}, not only {result.round}"
            if result.version_max > result.round
            else ""
        )
        log.info(
            "eval round %d, %s: %s (%d samples, %d failed groups%s)",
            result.round,
            result.task,
            {k: round(v, 4) for k, v in result.metrics.items()},
            result.num_samples,
            result.num_failed,
            rerun,
        )
        return True

    def poll(self, timeout_s: float = 0.0) -> int:
        """Record every eval result waiting on the control socket (waits up to ``timeout_s`` for
        the first message); returns how many messages were read. The thread's loop body; call it
        directly only while the thread is not running.

        Raises:
            RuntimeError: the eval-log thread is running (it owns the socket).
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("EvalLog.poll called from another thread while the eval-log thread owns the socket")
        read = 0
        msg = self.control.recv(timeout_s=timeout_s)
        while msg is not None:
            read += 1
            if isinstance(msg, EvalResult):
                try:
                    self.record(msg)
                except OSError:
                    log.exception("could not write eval round %d of %s to %s", msg.round, msg.task, self.metrics.path)
            msg = self.control.recv(timeout_s=0)
        return read

    def start(self) -> None:
        """Start the eval-log thread: from now on it alone reads the socket, until :meth:`close`.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("the eval-log thread is already running")
        self._thread = threading.Thread(target=self._loop, name="eval-log", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(timeout_s=RECV_SLICE_S)
            except Exception:  # a thread boundary: log it and keep the subscriber drained
                log.exception("eval-log thread: reading the control channel failed; going on")
                time.sleep(RECV_SLICE_S)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the eval-log thread and wait up to ``timeout_s`` for it (before the socket closes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the eval-log thread did not stop within %.1f s", timeout_s)

    def wait_for_round(self, round_: int, tasks: list[str], timeout_s: float, stop: threading.Event) -> list[str]:
        """Wait until every task of ``tasks`` has its result of ``round_`` written, ``timeout_s``
        passed, or ``stop`` is set; returns the tasks still missing (logged as a warning). Reads
        the socket itself when the thread is not running."""
        deadline = time.monotonic() + timeout_s

        def missing() -> list[str]:
            with self._changed:
                return [t for t in tasks if (round_, t) not in self.written]

        while (left := missing()) and time.monotonic() < deadline and not stop.is_set():
            wait_s = min(0.2, max(deadline - time.monotonic(), 0.0))
            if self._thread is None:
                self.poll(timeout_s=wait_s)
            else:
                with self._changed:
                    self._changed.wait(wait_s)
        left = missing()
        if left:
            log.warning(
                "no eval result of round %d for task(s) %s after %.1f s; ending the run without them",
                round_,
                ", ".join(left),
                timeout_s,
            )
        return left

    def wait_for_final_round(self, cfg: RunConfig, step: int, stop: threading.Event) -> list[str]:
        """After the last step, with ``eval.enabled``: wait up to ``eval.timeout_s`` for round
        ``step``'s result of every eval task (``eval.tasks``, or the training task); returns the
        missing ones (warned about), none when evaluation is off."""
        e = cfg.eval
        if not e.enabled:
            return []
        tasks = [t.name for t in e.tasks] or [cfg.task.name]
        return self.wait_for_round(step, tasks, e.timeout_s, stop)
