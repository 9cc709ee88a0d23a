"""The API's promises: every call gets a request id at once and its result later (``retrieve_future``).
:class:`Futures` lives on the web server's event loop: it orders each model's calls (:mod:`service.sequencer`),
hands the due ones to the trainer link, and completes a request when its :class:`bus.messages_api.ApiReply`
comes back. Calls held by a trainer that restarted fail with a clear error as soon as the new trainer answers
(a ping every :data:`PING_S` makes sure it does); one unanswered for :data:`CALL_TIMEOUT_S` fails too; results
are kept :data:`KEEP_S` after they are done, then retrieving them answers 410 (gone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

from bus.messages import new_id
from bus.messages_api import ApiCall, ApiReply
from service.sequencer import Sequencer

CALL_TIMEOUT_S = 900.0
PING_S = 5.0
KEEP_S = 3600.0

QUEUE_DEPTH = Gauge("rlbus_serve_queue_depth", "Calls of a model not yet answered (held or running)", ["model"])


@dataclass
class Request:
    """One call's promise: ``reply`` once done (ok or failed); ``extra``: what rendering its result needs."""

    request_id: str
    op: str
    model_id: str
    created: float
    extra: dict[str, Any] = field(default_factory=dict)
    sent: float | None = None
    reply: ApiReply | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Futures:
    """Request ids -> :class:`Request`; ``send`` hands a due :class:`ApiCall` to the trainer (thread-safe)."""

    def __init__(self, send: Callable[[ApiCall], None], gap_timeout_s: float = 5.0) -> None:
        self.send = send
        self.sequencer = Sequencer(gap_timeout_s)
        self.requests: dict[str, Request] = {}
        self._calls: dict[str, ApiCall] = {}
        self.engine: str | None = None
        self._pinged = 0.0

    def submit(self, call: ApiCall, seq_id: int | None = None, **extra: Any) -> str:
        """Register ``call`` (its id is the request id) and send it when due; a retry of a call already
        submitted (same model and ``seq_id``) returns the first copy's request id and sends nothing."""
        earlier = self.sequencer.known(call.model_id, seq_id)
        if earlier is not None:
            return earlier
        now = time.monotonic()
        self.requests[call.id] = Request(call.id, call.op, call.model_id, now, extra)
        self._calls[call.id] = call
        for due in self.sequencer.offer(call.model_id, seq_id, call.id, call.id, now):
            self._send(due)
        if call.model_id:
            self._gauge(call.model_id)
        return call.id

    def resolve(self, reply: ApiReply) -> None:
        """Complete the request ``reply`` answers (a reply for nothing known is dropped)."""
        self.note_engine(reply)
        req = self.requests.get(reply.call_id)
        if req is None or req.reply is not None:
            return
        req.reply = reply
        req.done.set()
        self._calls.pop(reply.call_id, None)
        if req.model_id:
            self._gauge(req.model_id)

    def fail(self, request_id: str, error: str, category: str = "server") -> None:
        """Complete ``request_id`` with an error."""
        self.resolve(ApiReply(id=new_id(), call_id=request_id, ok=False, error=error, category=category, body={}))

    async def wait(self, request_id: str, timeout_s: float) -> Request | None:
        """The request after up to ``timeout_s`` of waiting for it (done or not); None: unknown or expired."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        try:
            await asyncio.wait_for(req.done.wait(), timeout_s)
        except TimeoutError:
            pass
        return req

    def tick(self) -> None:
        """Close sequence gaps, fail calls the trainer never answered, forget old results, ping the trainer
        every :data:`PING_S` (call each second)."""
        now = time.monotonic()
        if now - self._pinged >= PING_S:
            self._pinged = now
            self.submit(ApiCall(id=new_id(), op="ping", model_id="", body={}))
        for due in self.sequencer.expire(now):
            self._send(due)
        for req in list(self.requests.values()):
            if req.reply is None and req.sent is not None and now - req.sent > CALL_TIMEOUT_S:
                self.fail(req.request_id, f"the trainer did not answer {req.op} within {CALL_TIMEOUT_S:.0f} s")
            elif req.reply is not None and now - req.created > KEEP_S:
                del self.requests[req.request_id]

    def depth(self, model_id: str) -> int:
        """Calls of ``model_id`` not answered yet."""
        return sum(1 for r in self.requests.values() if r.model_id == model_id and r.reply is None)

    def note_engine(self, reply: ApiReply) -> None:
        """Fail the trainer calls sent before ``reply``'s call when ``reply`` comes from another trainer process
        than the last reply did (it restarted: the calls it held are lost; later ones run on the new one)."""
        engine, req = reply.body.get("engine"), self.requests.get(reply.call_id)
        if not engine or req is None or req.op == "sample":
            return
        previous, self.engine = self.engine, engine
        if previous in (None, engine) or req.sent is None:
            return
        for lost in list(self.requests.values()):
            if lost.reply is None and lost.op != "sample" and lost.sent is not None and lost.sent < req.sent:
                self.fail(lost.request_id, "the trainer restarted while running this call; send it again")

    def _send(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is None:
            return
        self.requests[request_id].sent = time.monotonic()
        self.send(call)

    def _gauge(self, model_id: str) -> None:
        QUEUE_DEPTH.labels(model_id).set(self.depth(model_id))
