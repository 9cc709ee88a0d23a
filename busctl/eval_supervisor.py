"""The supervisor of ``busctl eval`` (:mod:`busctl.evaluate`): a :class:`busctl.supervisor.Supervisor`
that ends the run once every eval task's round-0 result is in (the packer writes them to
``eval.jsonl``), instead of at the trainer's ``run.done``.

Its own module so that ``busctl.evaluate`` (imported by every ``busctl`` command, ``--help``
included) does not import the supervisor (zmq, the wire messages, numpy) until ``busctl eval`` runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from busctl.supervisor import RunFailed, Supervisor

if TYPE_CHECKING:
    from rich.console import Console

    from configs.schema import RunConfig

__all__ = ["EvalSupervisor"]


class EvalSupervisor(Supervisor):
    """A :class:`busctl.supervisor.Supervisor` whose run ends when every eval task's round-0
    result is in.

    Attributes:
        results: ``{task: EvalResult}`` received so far (round 0, first of each task).
        tasks: the eval tasks waited for (:func:`tasks.registry.eval_tasks`).
    """

    def __init__(self, cfg: RunConfig, console: Console | None = None, **kwargs) -> None:
        from tasks.registry import eval_tasks

        if not cfg.eval.only:
            raise ValueError("EvalSupervisor runs eval.only configs (busctl.evaluate.eval_config)")
        super().__init__(cfg, console, **kwargs)
        self.tasks = {t.name for t in eval_tasks(cfg)}
        self.results: dict = {}
        self._deadline: float | None = None

    def watch(self) -> None:
        """:meth:`Supervisor.watch`, bounded by ``eval.timeout_s`` from now (after start-up)."""
        self._deadline = time.monotonic() + self.cfg.eval.timeout_s
        super().watch()

    def _turn(self) -> None:
        super()._turn()
        if self._deadline is not None and not self.run_done and time.monotonic() > self._deadline:
            missing = sorted(self.tasks - set(self.results))
            raise RunFailed(
                f"no eval result of task(s) {', '.join(missing)} within eval.timeout_s "
                f"({self.cfg.eval.timeout_s:.0f} s); see the packer's and producers' logs in {self.run_dir / 'logs'}"
            )

    def _handle(self, msg: object) -> None:
        from bus.messages import EvalResult

        if not isinstance(msg, EvalResult):
            super()._handle(msg)
            return
        if msg.round != 0 or msg.task in self.results or msg.task not in self.tasks:
            return  # a re-publication, or a stranger
        self.results[msg.task] = msg
        self.say(
            f"  [green]eval[/green] {msg.task}: reward_mean {msg.metrics.get('reward_mean', float('nan')):.4f} "
            f"({msg.num_samples} samples, {msg.num_failed} failed groups)"
        )
        if self.tasks <= set(self.results):
            self.run_done = True
