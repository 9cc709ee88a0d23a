"""The bus method (`broadcast.method: bus`, or `broadcast.fallback: bus`): weights as zero-copy
ZeroMQ frames over the bus, `BusSender` (trainer) and `BusReceiver` (producer process; its vLLM
workers fetch, `broadcaster.bus_fetch`).

    trainer                                             producer i's vLLM worker
    BusSender.start_send(sd, v): copy into the bucket
      buffers, serve them                               (DEALER, connected to the `weights` endpoint)
    announce weights.ready(v, method "bus", manifest)
                                   <-- weights.request(v, buckets [k, k+1]) --
      WeightServer thread (ROUTER) -- weights.bucket(latest, k, crc32, frame) -->  check, copy once
      ... until every bucket is in; loads through vLLM's reload_weights, as the broadcast receiver

Why pull (ROUTER on the trainer, a DEALER per worker asking for a window of buckets) and not PUB:
PUB sends every version to every subscriber at the pace of the slowest and drops at the HWM
without telling anyone, so a slow or late producer would lose buckets and the trainer could not
know; and a late joiner would have to wait for the next version. Pulling, each receiver takes its
own pace, a late joiner (restarted, `busctl scale`, a re-form miss) fetches the current version
the moment it asks, and the trainer never queues more per peer than that peer asked for
(`bus.topics` "weights": the ROUTER drops at its HWM and towards a lost peer; the receiver asks
again). It needs no shared filesystem and no torch.distributed group: tcp:// + CurveZMQ reaches
other hosts like every other topic.

Invariants:
- Bounded memory: the trainer keeps ONE version, the latest, in flat bucket buffers allocated
  once (`broadcaster.dist_broadcast.SendBuffers`, always in host memory). A request for an older
  version is answered with the latest (the receiver starts over on it).
- One copy on each side: the trainer copies (and casts) the payload into the bucket buffers and
  sends frames that alias them (`copy=False`); the receiver copies each frame once into its own
  flat buffer. So the buffers are never refilled while ZeroMQ may still read them: `start_send`
  first stops serving the old version and waits for every frame sent from it to be released
  (ZeroMQ message trackers); frames a dead peer's pipe still holds after `retire_timeout_s` are
  left to ZeroMQ, and the next version goes into freshly allocated buffers instead.
- Integrity: each bucket carries its size and `zlib.crc32` (computed by the server thread at the
  bucket's first request, so not on the trainer thread); a bad frame is counted by the receiver
  and asked again (`broadcaster.bus_fetch`).
- Order: the version is served before it is announced (as the filesystem method writes first),
  so a producer acting on `weights.ready` always finds it.
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
"""How often the server thread wakes to check for a stop or a version to serve, milliseconds."""

_MAX_WAITING = 1024
"""Most requests kept while nothing is served (a few per producer worker in practice)."""


@dataclass(frozen=True)
class BusLink:
    """Where the bus method's frames go: the `weights` endpoint and how to reach it.

    Attributes:
        address: the endpoint (`bus.topics.Endpoints.address("weights")`).
        ctx: the trainer's `zmq.Context` (its CURVE settings secure the ROUTER); None on producers.
        keys_dir, client: the producers' CurveZMQ key directory and client keypair (`bus.auth`;
            "" = plaintext), handed to the vLLM workers, which open their own sockets.
    """

    address: str
    ctx: zmq.Context | None = None
    keys_dir: str = ""
    client: str = ""

    @classmethod
    def connecting(cls, address: str, keys: auth.CurveKeys | None) -> "BusLink":
        """A producer's link: `address` and the keys its process uses (`bus.auth.keys_from_config`;
        None: plaintext), handed on to its vLLM workers as plain strings."""
        return cls(address, keys_dir=str(keys.keys_dir) if keys else "", client=keys.client if keys else "")


@dataclass
class _Served:
    """One version being served: its bucket byte arrays (aliasing the send buffers), checksums,
    and the trackers of every frame sent from them."""

    version: int
    arrays: list[np.ndarray]
    bucket_bytes: int
    crc32: dict[int, int] = field(default_factory=dict)
    """Checksums computed so far (on the server thread, at a bucket's first request: off the
    trainer thread; zlib releases the GIL while it runs)."""
    trackers: list[zmq.MessageTracker] = field(default_factory=list)

    def checksum(self, index: int) -> int:
        """`bucket_checksum` of bucket `index`, computed once."""
        if index not in self.crc32:
            self.crc32[index] = bucket_checksum(self.arrays[index])
        return self.crc32[index]


class WeightServer:
    """The trainer's ROUTER on the `weights` endpoint and the thread that answers requests.

    Args:
        ctx: the process's context (CURVE when it has it: the ROUTER is the server).
        address: the endpoint to bind.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        declare_topic("weights", "send", reliable=False)
        declare_topic("weights", "recv", reliable=False)
        self.address = address
        self.sock = ctx.socket(zmq.ROUTER)
        configure_socket(self.sock, ctx, hwm=TOPICS["weights"].hwm, bind=True)
        self.sock.bind(address)  # handed to the thread below, which alone uses it from here on
        self._lock = threading.Lock()
        self._served: _Served | None = None
        self._waiting: list[tuple[bytes, WeightsRequest]] = []
        """Requests that came while nothing was served (before the first version, during a swap),
        at most `_MAX_WAITING` (a receiver asks again for what is dropped beyond)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weight-server", daemon=True)
        self._thread.start()

    def serve(self, version: int, arrays: list[np.ndarray], bucket_bytes: int) -> None:
        """Serve `arrays` (`[nbytes] uint8` per bucket, kept alive by the caller) as `version`."""
        served = _Served(version, arrays, bucket_bytes)
        with self._lock:
            self._served = served

    def retire(self, timeout_s: float) -> bool:
        """Stop serving the current version and wait up to `timeout_s` for ZeroMQ to release every
        frame sent from it; returns whether it did (so its buffers may be refilled)."""
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
        """Send the requested buckets of the served version (zero-copy, tracked); with nothing
        served, keep the request until something is."""
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
    """Trainer side of the bus method (see the module docstring).

    Args:
        ctx: the trainer's `zmq.Context`.
        address: the `weights` endpoint to bind (at `open`, or the first `start_send`).
        bucket_bytes: bucket size (the producers plan with the same default).
        retire_timeout_s: how long `start_send` waits for ZeroMQ to release the previous version's
            frames before it allocates new buffers instead of refilling, seconds.

    Raises:
        ValueError: `bucket_bytes <= 0` or `retire_timeout_s < 0`.
    """

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
        """Copy `state_dict` into the bucket buffers (cast to the manifest's dtypes) and serve it
        as `version` from now on; returns `{"method", "version", "manifest", "path": None,
        "num_bytes", "bucket_bytes", "blocked_s"}`. Nothing stays in flight: producers pull.

        Raises:
            ValueError: a bad payload (`build_manifest`).
            zmq.ZMQError: the endpoint cannot be bound (first call without `open`).
        """
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
    """Producer side of the bus method: each announced version is fetched by the engine's vLLM
    workers over their own DEALER (`broadcaster.bus_fetch`).
    Any version is applicable (an older one too: a resumed trainer rolls the policy back);
    the version applied may be newer than the announced one (the trainer serves its latest).

    Args:
        engine: the producer's `producers.engine.RolloutEngine`.
        link: the `weights` endpoint and the CurveZMQ keys (`BusLink`).
        name: this producer's name (in its requests).
        timeout_s: bound on fetching one version, seconds.
    """

    method: ClassVar[str] = "bus"

    def __init__(self, engine: Any, link: BusLink, *, name: str = "", timeout_s: float = 300.0) -> None:
        self.engine, self.link, self.name, self.timeout_s = engine, link, name, timeout_s
        declare_topic("weights", "recv", reliable=False)

    async def apply(self, msg: Any) -> int:
        """Fetch and load the version `msg` announces (`RolloutEngine.apply_rpc` of the worker
        extension's `receive_weights_bus`); returns the version loaded. Counts what the workers
        received and rejected on the `weights` topic (`rlbus_bus_*{topic="weights"}`)."""
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
