"""The two ends of the ``api`` topic (:mod:`bus.messages_api`): :class:`ApiServer`, the trainer's ROUTER that
takes calls and answers each to its sender, and :class:`ApiClient`, the API process's DEALER. Both are used by
one thread each; CURVE applies when the context has keys (:func:`bus.sockets.configure_socket`). A frame that
does not decode is logged and dropped (the caller's request then times out or is retried).
"""

from __future__ import annotations

import logging

import zmq

from bus.codec import decode, encode
from bus.messages import Message
from bus.messages_api import ApiCall, ApiReply
from bus.sockets import configure_socket
from bus.topics import TOPICS
from bus.wire import WireError

log = logging.getLogger(__name__)


def _decode(frames: list, kind: type[Message]) -> Message | None:
    try:
        msg = decode(frames)
    except WireError as err:
        log.warning("api: dropped a message that does not decode: %s", err)
        return None
    if not isinstance(msg, kind):
        log.warning("api: dropped a %s (expected %s)", type(msg).__name__, kind.__name__)
        return None
    return msg


class ApiServer:
    """The trainer's end: a ROUTER bound at ``address``. Raises zmq.ZMQError: the address cannot be bound."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        configure_socket(self.sock, ctx, hwm=TOPICS["api"].hwm, bind=True)
        self.sock.bind(address)

    def recv(self, timeout_s: float) -> tuple[bytes, ApiCall] | None:
        """The next call with its sender's identity, or None after ``timeout_s`` (or a bad frame)."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        msg = _decode(frames, ApiCall)
        return None if msg is None else (identity.bytes, msg)  # type: ignore[return-value]

    def reply(self, identity: bytes, reply: ApiReply) -> None:
        """Send ``reply`` to the client ``identity`` (dropped if it is gone)."""
        try:
            self.sock.send_multipart([identity, *encode(reply)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("api: reply %s dropped (client gone or full)", reply.call_id)

    def close(self) -> None:
        self.sock.close(linger=0)


class ApiClient:
    """The API process's end: a DEALER connected to the trainer's ``address``."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        configure_socket(self.sock, ctx, hwm=TOPICS["api"].hwm, bind=False)
        self.sock.setsockopt(zmq.IMMEDIATE, 0)  # queue calls until the trainer is there
        self.sock.connect(address)

    def send(self, call: ApiCall) -> None:
        """Queue ``call`` for the trainer."""
        self.sock.send_multipart(encode(call), copy=False)

    def recv(self, timeout_s: float) -> ApiReply | None:
        """The next reply, or None after ``timeout_s`` (or a bad frame)."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return _decode(self.sock.recv_multipart(copy=False), ApiReply)  # type: ignore[return-value]

    def close(self) -> None:
        self.sock.close(linger=0)
