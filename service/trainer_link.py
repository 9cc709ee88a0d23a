"""The API process's thread on the ``api`` topic (:class:`bus.api_link.ApiClient`): it sends the calls queued by
the web server and hands each reply to ``on_reply`` (which moves it onto the event loop)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from bus.api_link import ApiClient
from bus.messages_api import ApiCall, ApiReply

log = logging.getLogger(__name__)


class TrainerLink:
    """One DEALER to the trainer's ``address`` and the thread that owns it; :meth:`send` is thread-safe."""

    def __init__(self, ctx: zmq.Context, address: str, on_reply: Callable[[ApiReply], None]) -> None:
        self._client = ApiClient(ctx, address)
        self._on_reply = on_reply
        self._out: queue.Queue[ApiCall] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainer-link", daemon=True)
        self._thread.start()

    def send(self, call: ApiCall) -> None:
        self._out.put(call)

    def _loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._client.send(self._out.get_nowait())
                except queue.Empty:
                    break
            reply = self._client.recv(timeout_s=0.01)
            while reply is not None:
                self._on_reply(reply)
                reply = self._client.recv(timeout_s=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._client.close()
