"""The trainer's wait for the final eval round: after its last step, up to ``eval.timeout_s`` for the
``eval.result`` of round ``max_steps`` of every eval task, so that its ``run.done`` (which ends the
run) does not cut that round short. The packer writes the records (``eval.jsonl``); the trainer
only waits, on a control subscriber opened before the last step's weights go out (docs/ARCHITECTURE.md,
"Online evaluation").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from bus.messages import EvalResult
from tasks.registry import eval_tasks

if TYPE_CHECKING:
    from bus.sockets import BusSocket
    from configs.schema import RunConfig

log = logging.getLogger(__name__)

__all__ = ["final_round_tasks", "wait_for_round"]


def final_round_tasks(cfg: RunConfig) -> list[str]:
    """The eval tasks whose final round the trainer waits for (:func:`tasks.registry.eval_tasks`);
    none when evaluation is off."""
    return [task.name for task in eval_tasks(cfg)]


def wait_for_round(
    control: BusSocket, round_: int, tasks: list[str], timeout_s: float, stop: threading.Event
) -> list[str]:
    """Read ``control`` until an ``eval.result`` of ``round_`` has come for every task of
    ``tasks``, ``timeout_s`` seconds passed, or ``stop`` is set; returns the tasks still missing
    (logged as a warning). Every other message is dropped."""
    missing = list(tasks)
    deadline = time.monotonic() + timeout_s
    while missing and not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        msg = control.recv(timeout_s=min(0.2, left))
        if isinstance(msg, EvalResult) and msg.round == round_ and msg.task in missing:
            missing.remove(msg.task)
    if missing:
        log.warning(
            "no eval result of round %d for task(s) %s after %.1f s; ending the run without them",
            round_,
            ", ".join(missing),
            timeout_s,
        )
    return missing
