"""The soak's hostile traffic: garbage frames at every bus endpoint of a run, and, over tcp, at
its metrics endpoints without a client certificate (used by :mod:`bench.soak`).

Over ``ipc`` every socket is plaintext, as the run's own. Over ``tcp`` + CurveZMQ two kinds of
sender reach every endpoint:

- **authenticated** senders, CURVE clients with the run's own client key (a buggy or compromised
  peer that got in): their frames reach the receivers, which must count and drop every one
  (``rlbus_bus_rejected_total``) and lose nothing already accepted;
- **unauthenticated** senders, plaintext sockets with no key: the CURVE handshake refuses them,
  so none of their frames is delivered (the receivers' rejected counters do not move for them).

The metrics probe asks every component's ``/metrics`` over HTTPS without a client certificate
and over plain HTTP; an answer (an HTTP status line) is counted in ``metrics_answered`` and must
stay 0 (:mod:`telemetry.tls`).
"""

from __future__ import annotations

import http.client
import importlib.util
import socket
import ssl
import sys
import threading
from pathlib import Path

import zmq

from bus.auth import CurveAuth, CurveKeys
from bus.messages import GroupsDropped, GroupsTrained, Prompt, RolloutGroup, ScoredGroup
from bus.topics import Endpoints

BURST = 50
"""Hostile frame sets sent to each endpoint per second (by each sender kind)."""


def load_fuzz():
    """``tests/bus/fuzz.py`` as module ``fuzz`` (it is not a package module)."""
    if "fuzz" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "fuzz", Path(__file__).resolve().parents[1] / "tests" / "bus" / "fuzz.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["fuzz"] = module
        spec.loader.exec_module(module)
    return sys.modules["fuzz"]


def targets(num_producers: int) -> list[tuple[str, int, int, object]]:
    """``(topic, index, socket type, frame generator)`` of every bus endpoint a run binds: each
    generator yields messages invalid for that endpoint's receiver (:mod:`tests.bus.fuzz`)."""
    fuzz = load_fuzz()
    out = [
        ("scored", 0, zmq.DEALER, fuzz.HostileEnvelopes(101, "inbox", (ScoredGroup,))),
        ("batches", 0, zmq.DEALER, fuzz.HostileEnvelopes(103, "outbox", (ScoredGroup,))),
        ("prompts", 0, zmq.DEALER, fuzz.HostileEnvelopes(104, "outbox", (Prompt,))),
        ("outcomes", 0, zmq.DEALER, fuzz.HostileEnvelopes(106, "inbox", (GroupsDropped, GroupsTrained))),
        ("control_pub", 0, zmq.PUB, fuzz.HostileMessages(102, None)),
        ("weights", 0, zmq.DEALER, fuzz.HostileMessages(107, None)),
    ]
    out += [
        ("rollouts", i, zmq.DEALER, fuzz.HostileEnvelopes(105 + 10 * i, "outbox", (RolloutGroup,)))
        for i in range(num_producers)
    ]
    return out


class Garbage(threading.Thread):
    """Sends :data:`BURST` hostile frame sets per second, per sender kind, to every endpoint of
    :func:`targets` until ``stop``; never blocks (NOBLOCK: what ZeroMQ cannot take now is skipped).

    Args:
        endpoints: the run's endpoints (its transport, host and base port).
        keys_dir: the run's CurveZMQ key directory (tcp), or None (ipc: plaintext senders only).
        num_producers: producers whose ``rollouts`` endpoints get garbage.
        stop: set to end the thread.

    Attributes:
        sent: ``{"authenticated" | "plaintext": frame sets handed to ZeroMQ}``. Over tcp the
            plaintext ones never pass the CURVE handshake; over ipc plaintext is the run's own
            mechanism, so they are delivered.
    """

    def __init__(self, endpoints: Endpoints, keys_dir: Path | None, num_producers: int, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="garbage")
        self.ctx = zmq.Context()
        curve = CurveAuth(self.ctx, CurveKeys.load(keys_dir)) if keys_dir else None
        self.senders: list[tuple[str, zmq.Socket, list]] = []
        for topic, index, kind, gen in targets(num_producers):
            frames = gen.take(2000)
            for label in ["authenticated", "plaintext"] if curve else ["plaintext"]:
                sock = self.ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 1)
                if label == "authenticated":
                    curve.secure(sock, server=False)
                sock.connect(endpoints.address(topic, index))
                self.senders.append((label, sock, frames))
        self.stop = stop
        self.sent = {label: 0 for label, _, _ in self.senders}

    def run(self) -> None:
        i = 0
        while not self.stop.wait(1.0):
            for label, sock, frames in self.senders:
                for k in range(BURST):
                    try:
                        sock.send_multipart(frames[(i + k) % len(frames)], flags=zmq.NOBLOCK)
                        self.sent[label] += 1
                    except zmq.Again:
                        break
            i += BURST
        for _, sock, _ in self.senders:
            sock.close(linger=0)
        self.ctx.term()


def probe_metrics(host: str, port: int, timeout_s: float = 3.0) -> dict[str, bool]:
    """Ask ``host:port``'s ``/metrics`` over HTTPS without a client certificate and over plain
    HTTP.

    Returns:
        ``{"https_no_cert": answered, "http": answered}``: answered is True when an HTTP status
        line came back (the endpoint served someone without the run's client certificate).
    """
    answered = {}
    no_verify = ssl.create_default_context()
    no_verify.check_hostname, no_verify.verify_mode = False, ssl.CERT_NONE
    for name, make in (
        ("https_no_cert", lambda: http.client.HTTPSConnection(host, port, timeout=timeout_s, context=no_verify)),
        ("http", lambda: http.client.HTTPConnection(host, port, timeout=timeout_s)),
    ):
        conn = make()
        try:
            conn.request("GET", "/metrics")
            conn.getresponse()
            answered[name] = True
        except (OSError, ssl.SSLError, http.client.HTTPException, socket.timeout):
            answered[name] = False
        finally:
            conn.close()
    return answered
