"""The bus method (`broadcast.method: bus` or `broadcast.fallback: bus`): weights as zero-copy ZeroMQ frames,
`BusSender` (trainer, a ROUTER served by `WeightServer`'s thread) and `BusReceiver` (producer; its vLLM workers
pull with `broadcaster.bus_fetch`). Pull, not PUB: a slow or late producer loses nothing and the trainer queues
at most what a peer asked for (docs/ARCHITECTURE.md, "Weights").

The trainer keeps ONE version, the latest, in host `SendBuffers` allocated once, and serves it before announcing
it. Frames alias the buffers (`copy=False`), so `start_send` first retires the old version and waits for ZeroMQ's
message trackers; after `retire_timeout_s` (a dead peer's pipe) the new version goes into fresh buffers. Each
bucket's `zlib.crc32` is computed on the server thread at its first request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import zmq

from broadcaster.base import WeightReceiver, WeightSender
from broadcaster.dist_broadcast import SendBuffers
from broadcaster.bus_fetch import bucket_checksum
from broadcaster.manifest import DEFAULT_BUCKET_BYTES
from bus import auth
from bus.codec import decode, encode
from bus.messages_weights import WeightsBucket, WeightsRequest
from telemetry.metrics import BUS_BYTES, BUS_MESSAGES, BUS_REJECTED, declare_topic
from bus.sockets import configure_socket
from bus.topics import TOPICS
from bus.wire import WireError

logger = logging.getLogger(__name__)

__all__ = ["BusLink", "BusReceiver", "BusSender", "WeightServer"]

_POLL_MS = 50
"""How often the server thread checks for a stop or a version to serve, milliseconds."""

_MAX_WAITING = 1024
"""Most requests kept while nothing is served (a few per producer worker in practice)."""


@dataclass(frozen=True)
class BusLink:
    """The `weights` endpoint and how to reach it: the trainer's `ctx` (its CURVE secures the ROUTER; None on
    producers), or the producers' CurveZMQ `keys_dir`/`client` ("": plaintext) for their vLLM workers' sockets."""

    address: str
    ctx: zmq.Context | None = None
    keys_dir: str = ""
    client: str = ""

    @classmethod
    def connecting(cls, address: str, keys: auth.CurveKeys | None) -> "BusLink":
        """A producer's link: `address` and its process's keys (None: plaintext), as strings for the workers."""
        return cls(address, keys_dir=str(keys.keys_dir) if keys else "", client=keys.client if keys else "")


@dataclass
class _Served:
    """One version being served: bucket byte arrays (aliasing the send buffers), checksums, frame trackers."""

    version: int
    arrays: list[np.ndarray]
    bucket_bytes: int
    crc32: dict[int, int] = field(default_factory=dict)  # filled by the server thread (zlib releases the GIL)
    trackers: list[zmq.MessageTracker] = field(default_factory=list)

    def checksum(self, index: int) -> int:
        """`bucket_checksum` of bucket `index`, computed once."""
        if index not in self.crc32:
            self.crc32[index] = bucket_checksum(self.arrays[index])
        return self.crc32[index]


class WeightServer:
    """The trainer's ROUTER on `address` (CURVE server when `ctx` has keys) and the thread answering requests.
    Raises zmq.ZMQError: the endpoint cannot be bound."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        declare_topic("weights", "send", reliable=False)
        declare_topic("weights", "recv", reliable=False)
        self.address = address
        self.sock = ctx.socket(zmq.ROUTER)
        configure_socket(self.sock, ctx, hwm=TOPICS["weights"].hwm, bind=True)
        self.sock.bind(address)  # handed to the thread below, which alone uses it from here on
        self._lock = threading.Lock()
        self._served: _Served | None = None
        self._waiting: list[tuple[bytes, WeightsRequest]] = []  # came while nothing was served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weight-server", daemon=True)
        self._thread.start()

    def serve(self, version: int, arrays: list[np.ndarray], bucket_bytes: int) -> None:
        """Serve `arrays` (`[nbytes] uint8` per bucket, kept alive by the caller) as `version`."""
        served = _Served(version, arrays, bucket_bytes)
        with self._lock:
            self._served = served

    def retire(self, timeout_s: float) -> bool:
        """Stop serving; whether ZeroMQ released every frame of it within `timeout_s` (buffers reusable)."""
        with self._lock:
            served, self._served = self._served, None
        if served is None:
            return True
        deadline = time.monotonic() + timeout_s
        for tracker in served.trackers:
            try:
                tracker.wait(max(deadline - time.monotonic(), 0.0))
            except zmq.NotDone:
                return False
        return True

    def close(self) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self.sock.closed:
            self.sock.close(linger=0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(_POLL_MS):
                frames = self.sock.recv_multipart(copy=False)
                try:
                    self._take(frames)
                except Exception:
                    logger.exception("weight request from %r failed", frames[0].bytes)
                    BUS_REJECTED.labels("weights", "decode").inc()
            if self._waiting and self._served is not None:
                waiting, self._waiting = self._waiting, []
                for identity, request in waiting:
                    self._answer(identity, request)

    def _take(self, frames: list[zmq.Frame]) -> None:
        """One received message `[identity, *message frames]`: answer it or count it rejected."""
        BUS_MESSAGES.labels("weights", "recv").inc()
        BUS_BYTES.labels("weights", "recv").inc(sum(len(f) for f in frames[1:]))
        try:
            request = decode(frames[1:])
            if not isinstance(request, WeightsRequest):
                raise WireError("unexpected_type", type(request).__name__)
        except WireError as exc:
            BUS_REJECTED.labels("weights", exc.reason).inc()
            return
        self._answer(frames[0].bytes, request)

    def _answer(self, identity: bytes, request: WeightsRequest) -> None:
        """Send the served version's requested buckets (zero-copy, tracked), or keep the request for later."""
        with self._lock:  # retire() cannot swap the version out while its frames are being queued
            served = self._served
            if served is None:
                if len(self._waiting) < _MAX_WAITING:
                    self._waiting.append((identity, request))
                return
            for index in request.buckets:
                if index >= len(served.arrays):
                    BUS_REJECTED.labels("weights", "inconsistent").inc()
                    continue
                data = served.arrays[index]
                header, payload = encode(
                    WeightsBucket(
                        id=f"{served.version}-{index}",
                        version=served.version,
                        index=index,
                        num_buckets=len(served.arrays),
                        bucket_bytes=served.bucket_bytes,
                        crc32=served.checksum(index),
                        data=data,
                    )
                )
                try:  # ROUTER never blocks: at the peer's HWM (or towards a lost peer) it drops, the peer re-asks
                    tracker = self.sock.send_multipart(
                        [identity, header, payload], flags=zmq.NOBLOCK, copy=False, track=True
                    )
                except zmq.Again:
                    continue
                served.trackers.append(tracker)
                BUS_MESSAGES.labels("weights", "send").inc()
                BUS_BYTES.labels("weights", "send").inc(len(header) + data.nbytes)


class BusSender(WeightSender):
    """Trainer side: binds `address` at `open` (or the first `start_send`).
    `retire_timeout_s`: wait for the previous version's frames before allocating new buffers, seconds. Raises
    ValueError: `bucket_bytes <= 0` or `retire_timeout_s < 0`."""

    method: ClassVar[str] = "bus"
    carries_adapter: ClassVar[bool] = True

    def __init__(
        self, ctx: zmq.Context, address: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, retire_timeout_s: float = 5.0
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if retire_timeout_s < 0:
            raise ValueError(f"retire_timeout_s must be >= 0, got {retire_timeout_s}")
        self.ctx, self.address = ctx, address
        self.bucket_bytes, self.retire_timeout_s = bucket_bytes, retire_timeout_s
        self.server: WeightServer | None = None
        self._buffers: SendBuffers | None = None

    def __str__(self) -> str:
        return f"the bus method at {self.address}"

    @property
    def buffers(self) -> SendBuffers | None:
        """The send buffers of the version being served (None before the first `start_send`)."""
        return self._buffers

    def open(self) -> None:
        """Bind the `weights` endpoint and start answering requests (idempotent)."""
        if self.server is None:
            self.server = WeightServer(self.ctx, self.address)
            logger.info("serving weights on %s", self.address)

    @torch.no_grad()
    def start_send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, manifest: list[list] | None = None
    ) -> dict:
        """Copy `state_dict` into the buffers (cast to wire dtypes) and serve it as `version`; nothing in flight.
        Returns the announcement plus `bucket_bytes`, `blocked_s`. Raises ValueError (a bad payload), zmq.ZMQError."""
        start = time.perf_counter()
        self.open()
        assert self.server is not None
        manifest = self.manifest(state_dict) if manifest is None else manifest
        released = self.server.retire(self.retire_timeout_s)
        if not released:
            logger.warning(
                "frames of the previous weights version still held by ZeroMQ after %.1f s (a peer lost "
                "mid-transfer): version %d goes into new buffers",
                self.retire_timeout_s,
                version,
            )
        if self._buffers is None or self._buffers.manifest != manifest or not released:
            self._buffers = SendBuffers.allocate(manifest, self.bucket_bytes, torch.device("cpu"))
        buffers = self._buffers
        for views, names in zip(buffers.views, buffers.names, strict=True):
            torch._foreach_copy_(views, [state_dict[name].detach() for name in names])  # casts to the wire dtype
        self.server.serve(version, [flat.view(torch.uint8).numpy() for flat in buffers.flats], self.bucket_bytes)
        return {
            "method": self.method,
            "version": version,
            "manifest": manifest,
            "path": None,
            "num_bytes": buffers.num_bytes,
            "bucket_bytes": self.bucket_bytes,
            "blocked_s": time.perf_counter() - start,
        }

    def close(self) -> None:
        """Stop serving and release the buffers (idempotent)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self._buffers = None


class BusReceiver(WeightReceiver):
    """Producer side: the engine's vLLM workers fetch each announced version (`timeout_s` each, seconds).
    Any version applies (an older one: a resumed trainer rolled back); the one loaded may be newer than announced."""

    method: ClassVar[str] = "bus"

    def __init__(self, engine: Any, link: BusLink, *, name: str = "", timeout_s: float = 300.0) -> None:
        self.engine, self.link, self.name, self.timeout_s = engine, link, name, timeout_s
        declare_topic("weights", "recv", reliable=False)

    async def apply(self, msg: Any) -> int:
        """Fetch and load `msg`'s version in the workers; the version loaded. Counts `rlbus_bus_*{topic="weights"}`."""
        reports: list[dict] = []
        kwargs = {
            "manifest": msg.manifest,
            "version": msg.version,
            "address": self.link.address,
            "producer": self.name,
            "keys_dir": self.link.keys_dir,
            "client": self.link.client,
            "timeout_s": self.timeout_s,
        }
        await self.engine.apply_rpc(msg.version, "receive_weights_bus", kwargs, reports=reports)
        for report in reports:
            for reason, count in report["rejected"].items():
                BUS_REJECTED.labels("weights", reason).inc(count)
            BUS_BYTES.labels("weights", "recv").inc(report["num_bytes"])
            BUS_MESSAGES.labels("weights", "recv").inc(report["num_buckets"])
        return reports[0]["version"]
