"""``busctl down --finish``: end a running job early and cleanly, as if ``trainer.max_steps`` were lower.

The client writes ``RUN_DIR/finish.json`` (``{"id": ...}``); ``busctl up`` publishes :class:`RunFinish` on
the control channel until the prompt source answers with :class:`RunFinalStep`: the steps whose prompts
are issued are trained, then the final checkpoint, the final eval round and exit 0, every issued prompt
with its one outcome (docs/ARCHITECTURE.md, "Finishing early"). ``status.json``'s ``final_step`` says
where the run now ends; the client waits for it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bus.control import ControlPublisher, Resender
from bus.messages import RunFinish, new_id
from runfiles.durable import write_text_atomic

__all__ = ["FINISH_FILE", "FinishRequests", "request_finish"]

FINISH_FILE = "finish.json"


class FinishRequests:
    """``busctl up``'s side: publishes :class:`RunFinish` every second (``resender``) while ``finish.json``
    exists and the prompt source has not answered with :class:`RunFinalStep`."""

    def __init__(self, run_dir: Path, open_publisher: Callable[[], ControlPublisher]) -> None:
        self.path = run_dir / FINISH_FILE
        self.resender = Resender(open_publisher)
        self.final_step: int | None = None  # from the prompt source's RunFinalStep

    def poll(self, now: float) -> None:
        """Publish :class:`RunFinish` if due (``now``: ``time.monotonic()``)."""
        if self.final_step is None and self.path.exists():
            self.resender.poll(now, lambda: RunFinish(id=new_id()))

    def close(self) -> None:
        """Close the publisher (reopened at the hub's address on the next send)."""
        self.resender.close()


def request_finish(run_dir: Path, read_status, alive, timeout_s: float) -> int | str:
    """Write the request and wait for ``status.json``'s ``final_step``; returns it, or why not (a string).

    ``read_status``: ``run_dir -> dict``; ``alive``: ``status -> bool`` (the supervisor still runs)."""
    write_text_atomic(run_dir / FINISH_FILE, json.dumps({"id": uuid.uuid4().hex}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(run_dir)
        if status.get("final_step") is not None:
            return int(status["final_step"])
        if not alive(status):
            return "busctl up stopped before the prompt source answered"
        time.sleep(0.2)
    return f"the prompt source did not answer within {timeout_s:.0f} s"
