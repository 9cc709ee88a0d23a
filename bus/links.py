"""The ZeroMQ sockets of a courier's boxes, each a numbered :class:`Link`. :func:`open_sockets` is all or
nothing: a failed bind or connect closes the sockets already made (``linger=0``), so a failed open holds no
endpoint. Called on the courier's I/O thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from bus.inbox import Inbox
from bus.outbox import Outbox
from bus.sockets import configure_socket
from bus.topics import TOPICS

SOCKET_HWM = 10_000  # credit keeps data far below it (envelopes are tiny)


@dataclass
class Link:
    """One socket of a box, a ROUTER (bound) or a DEALER (one endpoint); ``number``: its index in the
    courier's links (a :data:`bus.envelope.PeerKey`'s first element); ``closed``: its opening was abandoned."""

    number: int
    sock: zmq.Socket
    box: Inbox | Outbox
    router: bool
    closed: bool = False


def socket_type(box: Inbox | Outbox, bind: bool) -> int:
    """The socket type of ``box``'s side; ValueError if ``bind`` does not match it (the ROUTER binds)."""
    spec = TOPICS[box.topic]
    direction = "recv" if isinstance(box, Inbox) else "send"
    sock_type = spec.recv_type if direction == "recv" else spec.send_type
    if (sock_type == zmq.ROUTER) != bind:
        raise ValueError(f"the {direction} side of {box.topic} must {'bind' if sock_type == zmq.ROUTER else 'connect'}")
    return sock_type


def open_sockets(ctx: zmq.Context, box: Inbox | Outbox, endpoints: str | list[str], bind: bool) -> list[zmq.Socket]:
    """One ROUTER bound to every endpoint, or one DEALER connected to each, for ``box``.

    Raises:
        ValueError: see :func:`socket_type`. zmq.ZMQError: a bind or connect failed (sockets made here closed).
    """
    sock_type = socket_type(box, bind)
    eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    made: list[zmq.Socket] = []
    try:
        for group in [eps] if bind else [[ep] for ep in eps]:  # one DEALER per remote endpoint
            sock = ctx.socket(sock_type)
            made.append(sock)
            configure_socket(sock, ctx, hwm=SOCKET_HWM, bind=bind)
            if sock_type == zmq.ROUTER:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            for ep in group:
                (sock.bind if bind else sock.connect)(ep)
    except BaseException:
        for sock in made:
            sock.close(linger=0)
        raise
    return made
