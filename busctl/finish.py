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
from pathlib import Path

from bus.control import ControlPublisher
from bus.messages import RunFinish, new_id
from runfiles.durable import write_text_atomic

__all__ = ["FINISH_FILE", "FinishRequests", "request_finish"]

FINISH_FILE = "finish.json"
RESEND_S = 1.0
"""Period of :class:`RunFinish` while no :class:`RunFinalStep` was heard (PUB/SUB may drop one), seconds."""


class FinishRequests:
    """``busctl up``'s side: publishes :class:`RunFinish` while a request has no answer.

    ``publisher``: a zero-argument callable returning a :class:`ControlPublisher` (opened on the first
    request)."""

    def __init__(self, run_dir: Path, publisher) -> None:
        self.path = run_dir / FINISH_FILE
        self._open = publisher
        self._pub: ControlPublisher | None = None
        self._next_send = 0.0
        self.final_step: int | None = None  # from the prompt source's RunFinalStep

    def poll(self, now: float) -> None:
        """Publish :class:`RunFinish` every :data:`RESEND_S` while ``finish.json`` exists and no final step is known."""
        if self.final_step is not None or now < self._next_send or not self.path.exists():
            return
        if self._pub is None:
            self._pub = self._open()
        self._pub.send(RunFinish(id=new_id()))
        self._next_send = now + RESEND_S

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()
            self._pub = None


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
