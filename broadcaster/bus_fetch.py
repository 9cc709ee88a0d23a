"""Receive side of `broadcast.method: bus`: a DEALER pulling one version's buckets from the trainer's
`broadcaster.bus_method.WeightServer` into a `BucketReceiver`, inside each producer's vLLM worker.

It asks (`WeightsRequest`) for at most `window` missing buckets; the server answers each with a `WeightsBucket` of
its LATEST version, and a newer version restarts the fetch (versions never mix). Each frame is checked (size,
`zlib.crc32`) and copied once into its buffer; a bad frame is counted by reason (`size`, `checksum`,
`inconsistent`, a `WireError` reason) and asked again, as is a bucket unanswered after `retry_s` (the ROUTER drops
at its HWM). Views alias the buffers until the next `fetch`. Protocol: docs/ARCHITECTURE.md, "Weights".
"""

from __future__ import annotations

import logging
import time
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from broadcaster.buckets import BucketReceiver
from bus import auth
from bus.codec import decode, encode
from bus.messages_weights import WeightsBucket, WeightsRequest
from bus.sockets import configure_socket
from bus.topics import TOPICS
from bus.wire import WireError

logger = logging.getLogger(__name__)

__all__ = ["BusFetcher", "FetchResult", "bucket_checksum"]

DEFAULT_WINDOW = 2
"""Buckets asked for and not yet received (64 MiB in flight: keeps a tcp stream full while one is copied)."""

DEFAULT_RETRY_S = 2.0
"""A bucket asked for and not received within this long is asked again, seconds."""


def bucket_checksum(data: np.ndarray | memoryview) -> int:
    """`zlib.crc32` of a bucket's bytes (CRC-32, ISO 3309 / ITU-T V.42, as zlib computes it)."""
    return zlib.crc32(data)


@dataclass
class FetchResult:
    """One `fetch`: `version` now in the buffers (>= the one asked), `views` aliasing them, `rejected`
    `{reason: count}`, `num_bytes` accepted (restarts count again), `requests` sent."""

    version: int
    views: dict[str, torch.Tensor]
    rejected: dict[str, int] = field(default_factory=dict)
    num_bytes: int = 0
    requests: int = 0


class BusFetcher:
    """A DEALER connected to the trainer's `weights` endpoint.
    `keys_dir` "" is plaintext; `client` "" is `bus.auth.DEFAULT_CLIENT`. `window`: 1..64 buckets asked at once.
    Raises ValueError: a bad `window` or `retry_s`, or unusable keys."""

    def __init__(
        self,
        address: str,
        *,
        producer: str = "",
        keys_dir: str = "",
        client: str = "",
        window: int = DEFAULT_WINDOW,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if not 1 <= window <= 64:
            raise ValueError(f"window must be in 1..64 buckets, got {window}")
        if retry_s <= 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.address, self.producer, self.window, self.retry_s = address, producer, window, retry_s
        self.ctx = zmq.Context()
        auth.enable(self.ctx, auth.CurveKeys.load(keys_dir, client or auth.DEFAULT_CLIENT) if keys_dir else None)
        self.sock = self.ctx.socket(zmq.DEALER)
        configure_socket(self.sock, self.ctx, hwm=TOPICS["weights"].hwm, bind=False)
        self.sock.connect(address)

    def fetch(self, buffers: BucketReceiver, version: int, timeout_s: float = 300.0) -> FetchResult:
        """Receive `version` (or the newer one the trainer has instead) into `buffers`.
        Raises TimeoutError: not complete within `timeout_s` seconds (trainer gone, or every answer damaged)."""
        n = len(buffers.buckets)
        flats_u8 = [flat.view(torch.uint8) for flat in buffers.flats]
        target, missing, asked = version, set(range(n)), {}
        rejected: Counter[str] = Counter()
        num_bytes = requests = 0
        deadline = time.monotonic() + timeout_s
        while missing:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"weights version {target} over the bus: {len(missing)} of {n} buckets missing after "
                    f"{timeout_s} s from {self.address} (rejected on the way: {dict(rejected)})"
                )
            in_flight = sum(1 for k in missing if now - asked.get(k, -np.inf) < self.retry_s)
            wanted = [k for k in sorted(missing) if now - asked.get(k, -np.inf) >= self.retry_s][
                : max(self.window - in_flight, 0)
            ]
            if wanted and self._ask(target, wanted):
                requests += 1
                asked.update(dict.fromkeys(wanted, now))
            if not self.sock.poll(int(1000 * min(self.retry_s, max(deadline - now, 0.001)) / 4)):
                continue
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
                if not isinstance(msg, WeightsBucket):
                    raise WireError("unexpected_type", type(msg).__name__)
            except WireError as exc:
                rejected[exc.reason] += 1
                continue
            if msg.version < target:  # an answer of a version given up for a newer one
                continue
            reason = self._check(msg, buffers)
            if reason is not None:
                rejected[reason] += 1
                asked.pop(msg.index, None)  # ask again at once
                logger.warning("dropped bucket %d of weights version %d: %s", msg.index, msg.version, reason)
                continue
            if msg.version > target:  # the trainer has moved on: start over on its latest version
                target, missing, asked = msg.version, set(range(n)), {}
            if msg.index not in missing:  # a duplicate (asked twice)
                continue
            with warnings.catch_warnings():  # the frame is read-only; torch only reads it here
                warnings.simplefilter("ignore", UserWarning)
                flats_u8[msg.index].copy_(torch.from_numpy(msg.data))
            missing.discard(msg.index)
            num_bytes += msg.data.nbytes
        return FetchResult(target, buffers.views(), dict(rejected), num_bytes, requests)

    @staticmethod
    def _check(msg: WeightsBucket, buffers: BucketReceiver) -> str | None:
        """Why `msg` cannot fill its bucket of `buffers` (a reject reason), or None."""
        if msg.num_buckets != len(buffers.buckets) or msg.bucket_bytes != buffers.bucket_bytes:
            return "inconsistent"
        flat = buffers.flats[msg.index]
        if msg.data.nbytes != flat.numel() * flat.element_size():
            return "size"
        if bucket_checksum(msg.data) != msg.crc32:
            return "checksum"
        return None

    def _ask(self, version: int, buckets: list[int]) -> bool:
        """Send one request; False if no trainer is connected yet (IMMEDIATE: nothing queues)."""
        frames = encode(
            WeightsRequest(
                id=f"{self.producer}-{version}-{buckets[0]}", producer=self.producer, version=version, buckets=buckets
            )
        )
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        """Close the socket and the context (idempotent)."""
        if not self.ctx.closed:
            self.sock.close(linger=0)
            auth.disable(self.ctx)
            self.ctx.term()
