"""The process lifecycle every component shares (:func:`component_main`): load ``config.yaml``, die with the
supervisor, serve metrics, ``setup()``, ready handshake, heartbeats, ``run()``, keep serving metrics until
stopped, ``close()`` in a ``finally``; exit 0, or 1 after logging the exception (the only broad ``except``).
An orphaned component SIGKILLs its own process group after :data:`ORPHAN_GRACE_S`. The steps and reasons
are in docs/ARCHITECTURE.md, "Lifecycle and healing".
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import zmq

from bus import auth
from bus.control import ControlPublisher
from bus.courier import Courier
from bus.inbox import Inbox
from bus.messages import ComponentHeartbeat, ComponentPhase, ComponentReady, Message, new_id
from bus.outbox import Outbox
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import RunConfig, load_config
from lifecycle.launch_env import LaunchEnv
from lifecycle.parent_death import die_with_parent
from telemetry.failure_window import FailureWindows
from telemetry.metrics import POLICY_VERSION, serve_metrics
from telemetry.tls import server_context_for

log = logging.getLogger(__name__)

READY_SEND_TIMEOUT_S = 10.0  # seconds to deliver the ready handshake


class Component:
    """Base of a component process: owns the zmq context, its sockets and the stop event. ``launch``
    is the :class:`lifecycle.launch_env.LaunchEnv` read once from the environment.

    Raises:
        ValueError: a launch variable holds a value it cannot take.
    """

    def __init__(self, cfg: RunConfig, name: str, index: int) -> None:
        self.cfg = cfg
        self.name = name
        self.index = index
        self.launch = LaunchEnv.from_environ()
        self.run_dir = Path(cfg.run_dir)
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        # CURVE (tcp:// with bus.curve_keys_dir) secures every socket made from self.ctx
        auth.enable(self.ctx, auth.keys_from_config(cfg.bus))
        self.endpoints = Endpoints(
            cfg.bus.transport, self.run_dir, cfg.bus.host, cfg.bus.base_port, dict(cfg.bus.hosts)
        )
        self._sockets: list[BusSocket] = []
        self._courier: Courier | None = None
        self.heartbeat_state = ComponentPhase.RUNNING  # what the next heartbeat reports
        self.failures: FailureWindows | None = None  # user-function failure shares, carried by the heartbeats
        self.phase = ComponentPhase.STARTING  # shown on /health
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    def socket(
        self,
        topic: str,
        direction: str,
        endpoint: str | list[str],
        *,
        bind: bool,
        accept: tuple[type[Message], ...] | None = None,
    ) -> BusSocket:
        """Open a :class:`BusSocket` (see its arguments) that :meth:`close` will close."""
        sock = BusSocket(self.ctx, topic, direction, endpoint, bind=bind, stop=self.stop, accept=accept)
        self._sockets.append(sock)
        return sock

    @property
    def courier(self) -> Courier:
        """This process's :class:`bus.courier.Courier` (started on first use)."""
        if self._courier is None:
            b = self.cfg.bus
            self._courier = Courier(
                self.ctx,
                heartbeat_s=b.heartbeat_s,
                dead_after_s=b.dead_after_s,
                ack_timeout_s=b.ack_timeout_s,
                stop=self.stop,
                max_inflight_bytes=b.max_inflight_bytes,
            )
        return self._courier

    def reliable_receiver(
        self, topic: str, endpoint: str | list[str], *, bind: bool, accept: tuple[type[Message], ...]
    ) -> Inbox:
        """The receiving side of data topic ``topic`` (see :meth:`bus.courier.Courier.receiver`)."""
        return self.courier.receiver(topic, endpoint, bind=bind, accept=accept)

    def reliable_sender(self, topic: str, endpoint: str | list[str], *, bind: bool) -> Outbox:
        """The sending side of data topic ``topic`` (see :meth:`bus.courier.Courier.sender`)."""
        return self.courier.sender(topic, endpoint, bind=bind)

    def open_outcomes(self) -> Outbox:
        """A reliable sender of outcome reports to the prompt source's ledger; call once, in :meth:`setup`."""
        return self.reliable_sender("outcomes", self.endpoints.address("outcomes"), bind=False)

    def control_publisher(self) -> ControlPublisher:
        """A :class:`bus.control.ControlPublisher` connected to the control hub."""
        sock = ControlPublisher(self.ctx, self.endpoints.address("control_pub"), stop=self.stop)
        self._sockets.append(sock)
        return sock

    def control_subscriber(self) -> BusSocket:
        """A SUB socket connected to the control hub (subscribed to everything)."""
        return self.socket("control_sub", "recv", self.endpoints.address("control_sub"), bind=False)

    def setup(self) -> None:
        """Open sockets and load what the component needs; called before the ready handshake."""

    def run(self) -> None:
        """The component's main loop; returns when done or when ``self.stop`` is set."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything; always called, also after a failure."""
        self.stop_heartbeat()
        if self._courier is not None:
            self._courier.close()
        for sock in self._sockets:
            sock.close()
        auth.disable(self.ctx)  # stops the ZAP authenticator, which would keep term() waiting
        self.ctx.term()

    def health(self) -> tuple[bool, dict]:
        """``/health``: healthy while running or done; the body names component, phase, policy version."""
        body = {"component": self.name, "phase": self.phase, "policy_version": int(POLICY_VERSION._value.get())}
        return self.phase in (ComponentPhase.RUNNING, ComponentPhase.DONE), body

    def supervised_pid(self) -> int:
        """The pid the supervisor spawned: this process, unless a launcher (torchrun) stands between."""
        return os.getpid()

    def handshake_pid(self) -> int:
        """The id sent in the handshake and heartbeats: the launcher's spawn id, else :meth:`supervised_pid`."""
        return self.launch.spawn_id or self.supervised_pid()

    def report_ready(self, metrics_port: int, metrics_host: str = "") -> None:
        """Send the startup handshake to the supervisor (best effort when run standalone)."""
        sock = BusSocket(
            self.ctx, "supervisor", "send", self.endpoints.address("supervisor"), bind=False, stop=self.stop
        )
        try:
            msg: Message = ComponentReady(
                id=new_id(),
                name=self.name,
                pid=self.handshake_pid(),
                metrics_port=metrics_port,
                metrics_host=metrics_host,
            )
            if not sock.send(msg, timeout_s=READY_SEND_TIMEOUT_S):
                log.warning("no supervisor took the ready handshake; running standalone")
        finally:
            sock.close()

    def start_heartbeat(self) -> None:
        """Heartbeat every ``bus.heartbeat_s`` from a daemon thread with its own socket, until
        :meth:`stop_heartbeat`; one not delivered within a period is skipped."""
        if self._heartbeat_thread is not None:
            return
        period_s = self.cfg.bus.heartbeat_s
        pid = self.handshake_pid()

        def beat() -> None:
            sock = BusSocket(
                self.ctx,
                "supervisor",
                "send",
                self.endpoints.address("supervisor"),
                bind=False,
                stop=self._heartbeat_stop,
            )
            try:
                while not self._heartbeat_stop.is_set():
                    failures = self.failures.report() if self.failures is not None else {}
                    sock.send(
                        ComponentHeartbeat(
                            id=new_id(), name=self.name, pid=pid, state=self.heartbeat_state, failures=failures
                        ),
                        timeout_s=period_s,
                    )
                    self._heartbeat_stop.wait(period_s)
            finally:
                sock.close()

        self._heartbeat_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread and close its socket (before ``ctx.term()``); idempotent."""
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5.0)
            self._heartbeat_thread = None


ORPHAN_GRACE_S = 20.0  # an orphan's graceful stop before it SIGKILLs its group (busctl.scaling.STOP_TIMEOUT_S)
PARENT_POLL_S = 1.0  # how often watch_parent checks the supervisor, seconds

_orphan_lock = threading.Lock()
_orphan_timer: list[threading.Timer] = []  # at most one: armed once per process


def _on_stop_signal(comp: Component, parent_pid: int) -> None:
    """SIGTERM/SIGINT: stop ``comp``; if orphaned, arm (once) a timer that SIGKILLs our process group."""
    comp.stop.set()
    if os.getppid() != parent_pid and os.getpgrp() == os.getpid():  # orphaned, and leads its own group
        with _orphan_lock:
            if not _orphan_timer:
                timer = threading.Timer(ORPHAN_GRACE_S, os.killpg, args=(os.getpgrp(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
                _orphan_timer.append(timer)


def watch_parent(comp: Component, parent_pid: int) -> threading.Thread:
    """A daemon thread that calls :func:`_on_stop_signal` once ``parent_pid`` is gone: Python runs signal
    handlers on the main thread only, which a C call retrying on EINTR can block."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.warning(
            "the supervisor (pid %d) is gone: stopping, SIGKILL to this process group in %.0f s",
            parent_pid,
            ORPHAN_GRACE_S,
        )
        _on_stop_signal(comp, parent_pid)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def component_main(cls: type[Component], argv: list[str] | None = None) -> int:
    """Run a component through its lifecycle; returns the process exit code."""
    parser = argparse.ArgumentParser(description=f"rlbus component {cls.__name__}")
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    parser.add_argument("--name", required=True, help="component name, e.g. rewards-0")
    parser.add_argument("--index", type=int, default=0, help="replica index")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free port)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    die_with_parent(signal.SIGTERM)
    cfg = load_config(Path(args.run_dir) / "config.yaml")
    comp = cls(cfg, args.name, args.index)
    parent_pid = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: _on_stop_signal(comp, parent_pid))
    signal.signal(signal.SIGINT, lambda *_: _on_stop_signal(comp, parent_pid))
    watch_parent(comp, parent_pid)
    try:
        host = comp.launch.metrics_host  # the node's address on several nodes (RLBUS_NODE_ADDRESS)
        port = serve_metrics(
            args.metrics_port, host, health=comp.health, tls=server_context_for(cfg.bus, host)
        )  # TLS: tcp + CurveZMQ, this host's certificate
        comp.setup()
        comp.phase = ComponentPhase.RUNNING
        comp.report_ready(port, host)
        comp.start_heartbeat()
        log.info("ready (pid %d, metrics on %s:%d)", os.getpid(), host, port)
        comp.run()
        comp.heartbeat_state = comp.phase = ComponentPhase.DONE
        log.info("finished")
        comp.stop.wait()  # keep serving metrics until the supervisor stops us
        return 0
    except Exception:
        comp.phase = ComponentPhase.FAILED
        log.exception("%s failed", args.name)
        return 1
    finally:
        comp.close()


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` at once (``os._exit``), after flushing logging and every open writable
    file, skipping the interpreter's teardown. For a component whose ``close()`` has run and whose at-exit work
    is only slow: the producer's (torch.library unregistering vLLM's custom ops) and the trainer's (module
    teardown of torch and transformers), 2-4 s each on the 2-core host."""
    logging.shutdown()
    writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)  # by exact type: no isinstance hooks run
    for obj in gc.get_objects():
        if type(obj) in writers:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: nothing more to save
    os._exit(code)
