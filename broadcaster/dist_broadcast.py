"""The torch.distributed broadcast method: `BroadcastSender` (trainer, rank 0) and
`BroadcastReceiver` (producer process; its vLLM workers receive, `broadcaster.worker_extension`).

    trainer (rank 0)                                  producer engines (ranks 1..world_size-1)
    BroadcastSender.open()         <--- rendezvous --->  BroadcastReceiver.join()
                                                           -> RolloutEngine.init_weight_group(...)
    announce weights.ready(v, manifest), then
    BroadcastSender.start_send(sd, v) --- broadcast --->  BroadcastReceiver.apply(msg)
      ... trainer trains while bytes move ...              -> RolloutEngine.update_weights(v, manifest)
    BroadcastSender.wait()          (before the next start_send; raises SendFailed)

A stateless group (vLLM's `stateless_init_torch_distributed_process_group`, so vLLM must be
importable here too): gloo on CPU, nccl on CUDA ("auto" picks nccl iff CUDA is available), same
code. Tensors go in buckets (`broadcaster.manifest.plan_buckets`) through flat send buffers
allocated once and reused. A group has a fixed world size: when a producer joins (restart, late
join, `busctl scale`) or a member dies, the trainer forms a NEW group with a new rendezvous
(`broadcaster.regroup`, announced as `bus.messages_weights.WeightGroup`); `BroadcastReceiver.regroup`
leaves the old group and joins the new one, then expects the trainer to re-send its last version
into it (so a member already at that version receives it again, and a newcomer gets it at once).

The trainer does not wait on producers longer than the transfer itself. `start_send` copies the
payload into the send buffers on the caller's thread (bucket k is handed to the backend as soon as
it is filled, so it is on the wire while bucket k+1 is copied), and returns: the backend's own
threads move the bytes (gloo's worker threads; nccl's stream), a future callback records when the
last bucket is out (`transfer_s`). The caller may change its weights right away (the buffers hold
the copy). The next `start_send` (or `wait()`, `close()`) first waits for the previous transfer;
a transfer that failed raises `SendFailed` there, carrying the failed version and its payload
(views of the send buffers) so the caller can re-publish it by filesystem. `send` = `start_send`
+ `wait` (blocking). The nccl path (host-side completion by polling the works' CUDA events) is
written for GPUs but only the gloo path is exercised by the tests.

What to pass as `state_dict` (see `broadcaster.manifest` for both payload kinds): a Hugging Face
model's `state_dict()` with HF names ("full"), or a LoRA adapter payload
(`trainer.model.lora_adapter_state_dict`, "lora"), which the producers merge into the base weights
they keep. Raw PEFT names are rejected.

Dtypes: the send buffers have the manifest's dtypes, which may be narrower than the payload's
tensors (float32 master weights sent as bfloat16, `build_manifest(..., dtype=)`): the copy into the
buffers casts, so the wire carries the narrow bytes and no cast copy of the payload is made.

Ordering: `start_send` is a collective. `publish` announces `weights.ready(version, manifest)`
first, then calls it; producers call `RolloutEngine.update_weights(version, manifest)` on the
announcement. The manifest of one payload never changes during a run, so the buffers are
allocated once.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch

from broadcaster.base import Announce, SendFailed, WeightReceiver, WeightSender
from broadcaster.gloo_iface import pin_gloo_interface
from broadcaster.manifest import DEFAULT_BUCKET_BYTES, bucket_views, manifest_num_bytes, plan_buckets

logger = logging.getLogger(__name__)

__all__ = ["Backend", "BroadcastReceiver", "BroadcastSender", "SendBuffers", "SendFailed", "resolve_backend"]

Backend = Literal["auto", "gloo", "nccl"]

_POLL_S = 0.001
"""How often `wait` polls nccl work (whose wait() does not block the host), seconds."""


def resolve_backend(backend: Backend) -> Literal["gloo", "nccl"]:
    """ "auto" -> nccl if CUDA is available else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


@dataclass
class _Transfer:
    """One in-flight broadcast: its works, its payload views, when its first bucket was handed to
    the backend and (gloo: set by a future callback on the backend's thread) when all were done."""

    version: int
    works: list
    payload: dict[str, torch.Tensor]
    issued_at: float
    info: dict
    done_at: float | None = None

    def watch(self, backend: str) -> None:
        """Record `done_at` from the backend's own thread when every bucket is out (gloo)."""
        if backend == "gloo":
            futures = torch.futures.collect_all([w.get_future() for w in self.works])
            futures.add_done_callback(self._done)

    def _done(self, _future) -> None:
        self.done_at = time.perf_counter()

    def complete(self, backend: str, timeout_s: float | None) -> None:
        """Block until every bucket is out; raises the backend's error (or TimeoutError)."""
        if backend == "nccl":  # wait() only orders streams: poll the CUDA events for the host
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not all(w.is_completed() for w in self.works):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"nccl broadcast not done after {timeout_s} s")
                time.sleep(_POLL_S)
        for work in self.works:
            work.wait()
        if self.done_at is None:  # nccl, or the gloo callback has not run yet
            self.done_at = time.perf_counter()


@dataclass(frozen=True)
class SendBuffers:
    """The flat send buffers of one manifest, with per bucket its names and views into them
    (shared with `broadcaster.bus_method`, which serves the same buffers as bus frames)."""

    manifest: list[list]
    flats: list[torch.Tensor]
    names: list[list[str]]
    views: list[list[torch.Tensor]]
    payload: dict[str, torch.Tensor]
    num_bytes: int

    @classmethod
    def allocate(cls, manifest: list[list], bucket_bytes: int, device: torch.device) -> "SendBuffers":
        """Plan `manifest`'s buckets (`plan_buckets`) and allocate one flat buffer per bucket on `device`."""
        buckets = plan_buckets(manifest, bucket_bytes)
        flats = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in buckets]
        per_bucket = [bucket_views(b, f) for b, f in zip(buckets, flats, strict=True)]
        return cls(
            manifest,
            flats,
            [[n for n, _ in entries] for entries in per_bucket],
            [[v for _, v in entries] for entries in per_bucket],
            {n: v for entries in per_bucket for n, v in entries},
            manifest_num_bytes(manifest),
        )


class BroadcastSender(WeightSender):
    """Rank 0 of the weight group: sends each version by torch.distributed broadcast in the
    background (see the module docstring).

    Args:
        backend: "auto" | "gloo" | "nccl".
        host, port: where rank 0 hosts the rendezvous store; producers connect there.
        world_size: 1 (this trainer) + the number of producer workers.
        bucket_bytes: bucket size; producers must use the same (the default on both sides).
        timeout_s: bound on rendezvous and each collective (None: torch's default, 30 min gloo).
        listen_socket: a socket already bound (and listening) at `host:port` that the rendezvous
            store takes over (no race between picking a free port and binding it); None: bind
            `port` at `init_group`.

    Raises:
        ValueError: `world_size < 2`, `bucket_bytes <= 0`, or an unknown backend.
    """

    method: ClassVar[str] = "broadcast"
    carries_adapter: ClassVar[bool] = True

    def __init__(
        self,
        backend: Backend = "auto",
        host: str = "127.0.0.1",
        port: int = 29555,
        world_size: int = 2,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float | None = None,
        listen_socket: socket.socket | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + producers), got {world_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.backend = resolve_backend(backend)
        self.host, self.port, self.world_size = host, port, world_size
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._listen_socket = listen_socket
        self._group = None
        self._send_buffers: SendBuffers | None = None
        self._pending: _Transfer | None = None
        self.last_transfer: dict | None = None
        """Info of the last completed transfer (`start_send`'s dict + `transfer_s`), or None."""

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """`init_group` (the sender's `open`)."""
        self.init_group()

    def init_group(self) -> None:
        """Create the group as rank 0; blocks until all `world_size - 1` producer workers joined
        (idempotent). Producers call `RolloutEngine.init_weight_group` in any order relative to
        this, as long as all of them do within `timeout_s`.
        """
        if self._group is not None:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
        start = time.perf_counter()
        listen_socket, self._listen_socket = self._listen_socket, None  # the store owns it from here
        if self.backend == "gloo":
            pin_gloo_interface(self.host)  # the interface facing the producers, not the loopback
        self._group = stateless_init_torch_distributed_process_group(
            self.host,
            self.port,
            0,
            self.world_size,
            backend=self.backend,
            timeout=timeout,
            listen_socket=listen_socket,
        )
        logger.info(
            "weight group %s:%d up, world_size %d (%s), %.2f s",
            self.host,
            self.port,
            self.world_size,
            self.backend,
            time.perf_counter() - start,
        )

    def close(self) -> None:
        """Wait for an in-flight transfer (its collectives time out after `timeout_s`), tear the
        group down and release the send buffers (idempotent; a failed transfer is logged)."""
        if self._pending is not None:
            try:
                self.wait()
            except Exception:
                logger.warning("weight transfer in flight at close failed", exc_info=True)
            self._pending = None
        if self._group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            try:
                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception:
                logger.warning("weight group teardown failed", exc_info=True)
            self._group = None
        if self._listen_socket is not None:  # never handed to a store
            self._listen_socket.close()
            self._listen_socket = None
        self._send_buffers = None

    # -- sending ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """Whether a transfer was started and not yet waited for."""
        return self._pending is not None

    def transfer_finished(self) -> bool:
        """True if a transfer is in flight and the backend has finished it (successfully or not):
        `wait` then returns (or raises `SendFailed`) at once. Does not block."""
        transfer = self._pending
        return transfer is not None and all(w.is_completed() for w in transfer.works)

    @torch.no_grad()
    def start_send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, manifest: list[list] | None = None
    ) -> dict:
        """Start sending `state_dict` as policy `version`; returns what to announce.

        `manifest`: `self.manifest(state_dict)` if the caller already built it (to announce it),
        else built here.

        Returns `{"method", "version", "manifest", "path", "num_bytes", "bucket_bytes",
        "blocked_s"}`: `path` is None; `blocked_s` the seconds this call took (waiting for the
        previous transfer, copying into the send buffers, handing the buckets to the backend).
        The transfer goes on in the background (see the module docstring); `state_dict` may
        change once this returns.

        Raises:
            SendFailed: the PREVIOUS transfer failed (nothing of this version was sent).
            RuntimeError: no group (`init_group` first), or the backend refused the collective.
            ValueError: a bad payload (`build_manifest`).
        """
        start = time.perf_counter()
        manifest = self.manifest(state_dict) if manifest is None else manifest
        info = {
            "method": self.method,
            "version": version,
            "manifest": manifest,
            "path": None,
            "num_bytes": 0,
            "bucket_bytes": self.bucket_bytes,
        }
        if self._group is None:
            raise RuntimeError("send() before init_group()")
        self.wait()  # the previous transfer must be done before its buffers are refilled
        buffers = self._buffers(manifest)
        info["num_bytes"] = buffers.num_bytes
        works = []
        issued_at = None
        for flat, names, views in zip(buffers.flats, buffers.names, buffers.views, strict=True):
            # one dispatch per bucket; casts to the bucket's (wire) dtype on the way
            torch._foreach_copy_(views, [state_dict[name].detach() for name in names])
            works.append(self._group.broadcast(flat, 0))
            issued_at = issued_at or time.perf_counter()
        info["blocked_s"] = time.perf_counter() - start
        transfer = _Transfer(version, works, buffers.payload, issued_at or time.perf_counter(), info)
        transfer.watch(self.backend)
        self._pending = transfer
        return info

    def wait(self) -> dict | None:
        """Wait for the in-flight transfer; returns its info plus `transfer_s` (first bucket
        handed to the backend -> last bucket out), or None if there is none.

        Raises:
            SendFailed: the transfer failed or timed out (`timeout_s`); it is no longer in
                flight afterwards.
        """
        transfer, self._pending = self._pending, None
        if transfer is None:
            return None
        try:
            transfer.complete(self.backend, self.timeout_s)
        except Exception as exc:  # torch.distributed errors, timeouts
            raise SendFailed(transfer.version, transfer.payload, exc) from exc
        assert transfer.done_at is not None
        self.last_transfer = {**transfer.info, "transfer_s": transfer.done_at - transfer.issued_at}
        return self.last_transfer

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        announce: Announce,
        manifest: list[list] | None = None,
    ) -> dict:
        """Announce `version` first (producers join the collective on the announcement), then
        `start_send` it; returns `start_send`'s info. Raises as `start_send`."""
        manifest = self.manifest(state_dict) if manifest is None else manifest
        announce(
            {
                "method": self.method,
                "version": version,
                "manifest": manifest,
                "path": None,
                "num_bytes": manifest_num_bytes(manifest),
            }
        )
        return self.start_send(state_dict, version, manifest)

    def _buffers(self, manifest: list[list]) -> SendBuffers:
        """The send buffers of `manifest` (allocated and planned on its first send, then reused)."""
        if self._send_buffers is None or self._send_buffers.manifest != manifest:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
            )
            self._send_buffers = SendBuffers.allocate(manifest, self.bucket_bytes, device)
        return self._send_buffers


class BroadcastReceiver(WeightReceiver):
    """Producer side of the broadcast method: joins the group at start (unless the producer
    cannot be in it), receives each announced version into the engine, and moves to each group
    the trainer re-forms (`regroup`).

    Args:
        engine: the producer's `producers.engine.RolloutEngine`.
        host, port, world_size, timeout_s: the first group's rendezvous (`broadcast.*`).
        rank: the rank of this engine's first worker in the first group (1 + the producer's index).
        backend: "auto" | "gloo" | "nccl" (resolved here, as the trainer resolves it).
        in_group: False for a producer restarted or added after the first group was formed: it
            skips broadcasts (and takes filesystem announcements) until a re-formed group lists it.
        name: this producer's name (`producer-i`), how `WeightGroup` lists members.
        reform_timeout_s: bound on joining a re-formed group, seconds (None: `timeout_s`).
    """

    method: ClassVar[str] = "broadcast"

    def __init__(
        self,
        engine: Any,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: Backend = "auto",
        timeout_s: float | None = None,
        in_group: bool = True,
        name: str = "",
        reform_timeout_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.backend = resolve_backend(backend)
        self.timeout_s = timeout_s
        self.reform_timeout_s = timeout_s if reform_timeout_s is None else reform_timeout_s
        self.in_group = in_group
        self.name = name
        self.generation: int | None = 0 if in_group else None
        """The generation of the group this engine is in (`WeightGroup.generation`; None: none)."""
        self._joined_port: int | None = port if in_group else None
        self.expects_resend = False
        """Joined a re-formed group whose first broadcast (the trainer's last version again) is
        still to come: it is received even when this engine already has that version."""

    async def join(self) -> None:
        """Join the trainer's group (blocks until every rank is there); nothing if not `in_group`."""
        if self.in_group:
            await self.engine.init_weight_group(
                self.host,
                self.port,
                rank=self.rank,
                world_size=self.world_size,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )

    async def regroup(self, msg: Any, ack: Callable[[], None]) -> bool:
        """Move to the group `msg` (a `bus.messages_weights.WeightGroup`) announces: leave the old
        group, then if this producer is a member call `ack` and join the new one as
        `msg.rank_of(name)` (blocks until every rank joined or `reform_timeout_s` passed).

        Returns whether this engine is in the new group. A failed join is logged, not raised: the
        trainer blames the members that never acknowledged, re-forms without them, and this
        producer takes filesystem announcements until a group lists it again. A group that lists
        this producer nowhere (a restarted trainer that has not heard of it yet) makes it ask to
        be taken in (`wants_group`), as a newcomer does.
        """
        if (msg.generation, msg.port) == (self.generation, self._joined_port):
            return self.in_group  # a repeat of the group this engine already acted on
        rank = msg.rank_of(self.name)
        if self.in_group:
            await self.engine.leave_weight_group()
        self.in_group, self.generation, self.expects_resend = False, msg.generation, False
        self._joined_port = msg.port
        if rank is None:
            if self.name not in msg.filesystem:  # unknown to this trainer: ask like a newcomer
                self.generation = None
            logger.info(
                "weight group %d re-formed without %s: filesystem announcements only%s",
                msg.generation,
                self.name,
                "" if self.generation is not None else " (not listed: asking to join)",
            )
            return False
        ack()
        try:
            await self.engine.init_weight_group(
                msg.host,
                msg.port,
                rank=rank,
                world_size=msg.world_size,
                backend=self.backend,
                timeout_s=self.reform_timeout_s,
            )
        except Exception as exc:
            logger.error(
                "could not join weight group %d at %s:%d (%s: %s); filesystem announcements only",
                msg.generation,
                msg.host,
                msg.port,
                type(exc).__name__,
                exc,
            )
            return False
        self.in_group, self.expects_resend = True, True
        logger.info("joined weight group %d as rank %d/%d", msg.generation, rank, msg.world_size)
        return True

    @property
    def wants_group(self) -> bool:
        """Outside every group and never told which one to be in (a restarted, late or scaled-up
        producer): it asks the trainer to re-form the group with it."""
        return not self.in_group and self.generation is None

    def must_apply(self, msg: Any, current_version: int) -> bool:
        """Whether `msg` must be received although this engine has its version: the first
        broadcast into a group just joined (every rank must take part in the collective)."""
        return self.in_group and self.expects_resend and msg.method == self.method

    def skip_reason(self, msg: Any, current_version: int) -> str | None:
        """Not in the group, or an older version outside a resend (a resumed trainer re-publishes
        by filesystem; joining a collective nobody sends would block forever)."""
        if not self.in_group:
            return "not in the weight group"
        if msg.version < current_version and not self.expects_resend:
            return "older than the current version, not sent to the group again"
        return None

    async def apply(self, msg: Any) -> None:
        """Receive the broadcast of `msg.manifest` as `msg.version` (`RolloutEngine.update_weights`)."""
        await self.engine.update_weights(msg.version, msg.manifest, resend=self.expects_resend)
        self.expects_resend = False
