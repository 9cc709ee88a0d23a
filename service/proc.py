"""The ``serve`` component of ``busctl serve``: the FastAPI app (:mod:`service.app`) under uvicorn on
``serve.host:serve.port``, with the trainer link on the ``api`` topic. Its address goes to
``RUN_DIR/serve.json`` (``{"url": ...}``) once it listens; a restarted trainer's lost calls fail there. A run
with keys (tcp + ``bus.curve_keys_dir``, ``busctl keys``) serves HTTPS with the server certificate the metrics
servers would serve at ``serve.host`` (:meth:`telemetry.tls.MetricsTls.server_files`; no client certificate
asked: the API key authenticates), and the URL is ``https://``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import uvicorn

from bus.component import Component, component_main
from service.app import build_app
from service.futures import Futures
from service.keys import load_keys
from service.state import ServiceState
from service.trainer_link import TrainerLink
from telemetry.tls import TlsSettings, tls_from_config

log = logging.getLogger(__name__)


def tls_files(bus: TlsSettings, host: str) -> tuple[str, str] | None:
    """``(certificate, key)`` of the API bound at ``host`` on a run with keys, else None (plain HTTP).
    ValueError: as :func:`telemetry.tls.tls_from_config` and :meth:`telemetry.tls.MetricsTls.server_files`."""
    tls = tls_from_config(bus)
    return None if tls is None else tuple(str(p) for p in tls.server_files(host))  # type: ignore[return-value]


def api_server(app: object, certs: tuple[str, str] | None) -> uvicorn.Server:
    """uvicorn serving ``app``, over TLS with ``certs`` (from :func:`tls_files`) when given."""
    tls = {"ssl_certfile": certs[0], "ssl_keyfile": certs[1]} if certs else {}
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", **tls))


class ServeProc(Component):
    """The API process: uvicorn on its own thread (signals stay the component's), the link on another."""

    def setup(self) -> None:
        s = self.cfg.serve
        keys = load_keys(s.api_keys_file)
        self.state = ServiceState(self.cfg, keys, Futures(self._send))
        self.link = TrainerLink(self.ctx, self.endpoints.address("api"), self._on_reply)
        self.sampler_link = (
            TrainerLink(self.ctx, self.endpoints.address("samplers"), self._on_reply) if s.samplers else None
        )
        self.sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((s.host, s.port))
        host, port = self.sock.getsockname()[:2]
        certs = tls_files(self.cfg.bus, s.host)
        self.url = f"{'https' if certs else 'http'}://{host if ':' not in host else f'[{host}]'}:{port}"
        self.server = api_server(build_app(self.state), certs)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            raise RuntimeError(f"the API server did not start on {self.url}")
        (self.run_dir / "serve.json").write_text(json.dumps({"url": self.url}))
        log.info("API listening on %s (%d key(s))", self.url, len(keys))

    def _send(self, call) -> None:
        link = self.sampler_link if call.op == "sample" and self.sampler_link is not None else self.link
        link.send(call)

    def _on_reply(self, reply) -> None:
        loop = self.state.loop
        if loop is not None:
            loop.call_soon_threadsafe(self.state.futures.resolve, reply)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            if not self.thread.is_alive():
                raise RuntimeError("the API server stopped")

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        for link in (getattr(self, "link", None), getattr(self, "sampler_link", None)):
            if link is not None:
                link.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(ServeProc))
