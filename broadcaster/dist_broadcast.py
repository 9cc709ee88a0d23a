"""The torch.distributed broadcast method: `BroadcastSender` (trainer, rank 0) and `BroadcastReceiver`
(producer; its vLLM workers receive in `broadcaster.worker_extension`).

The group is vLLM's stateless process group (vLLM must be importable): gloo on CPU, nccl on CUDA. `publish`
announces `weights.ready` first (producers join the collective on it), then `start_send` copies the payload (HF
names, full or LoRA adapter, `broadcaster.manifest`) bucket by bucket into send buffers allocated once, casting to
the manifest's wire dtype, and hands each bucket to the backend, whose threads move the bytes while the trainer goes
on. The next `start_send`/`wait`/`close` waits for it; a failed transfer raises `SendFailed` there with the version
and its payload, for a filesystem re-publish. A group has a fixed world size; re-forming it is `broadcaster.regroup`
(docs/ARCHITECTURE.md, "Weights"). Only the gloo path runs in the tests; nccl polls CUDA events for completion.
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
"""How often `wait` polls nccl work (its wait() does not block the host), seconds."""


def resolve_backend(backend: Backend) -> Literal["gloo", "nccl"]:
    """ "auto" -> nccl if CUDA is available else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


@dataclass
class _Transfer:
    """One in-flight broadcast: its works, payload views, first-bucket time and (gloo callback) done time."""

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
    """One manifest's flat send buffers with per bucket its names and views (also served by `bus_method`)."""

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
    """Rank 0 of the weight group: sends each version by broadcast in the background.
    `host:port` hosts the rendezvous store (`listen_socket`: one already bound there, taken over by the store);
    `world_size` = 1 + producer workers; `bucket_bytes` must match the producers'; `timeout_s` bounds the rendezvous
    and each collective (None: torch's, 30 min for gloo). Raises ValueError: `world_size < 2`, `bucket_bytes <= 0`,
    an unknown backend."""

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
        # the last completed transfer: start_send's dict + transfer_s

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """`init_group` (the sender's `open`)."""
        self.init_group()

    def init_group(self) -> None:
        """Create the group as rank 0; blocks until all producer workers joined within `timeout_s` (idempotent)."""
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
        """Wait for a transfer in flight (failure logged), tear the group down, free the buffers (idempotent)."""
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
        """True if a transfer is in flight and finished, well or not (`wait` returns at once). Non-blocking."""
        transfer = self._pending
        return transfer is not None and all(w.is_completed() for w in transfer.works)

    @torch.no_grad()
    def start_send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, manifest: list[list] | None = None
    ) -> dict:
        """Start the background send of `state_dict` as `version`; `state_dict` may change once this returns.
        Returns the announcement plus `bucket_bytes` and `blocked_s` (seconds this call held the caller). Raises
        `SendFailed` (the PREVIOUS transfer failed; nothing of this one was sent), RuntimeError (no group, or the
        backend refused), ValueError (a bad payload)."""
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
        """Its info plus `transfer_s` (first bucket handed over -> last out), or None; `SendFailed` on failure."""
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
        """Announce `version` first (producers join the collective on it), then `start_send` it."""
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
        """`manifest`'s send buffers (allocated on its first send, then reused)."""
        if self._send_buffers is None or self._send_buffers.manifest != manifest:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
            )
            self._send_buffers = SendBuffers.allocate(manifest, self.bucket_bytes, device)
        return self._send_buffers


class BroadcastReceiver(WeightReceiver):
    """Producer side: joins the first group, receives each announced version, follows re-formed groups.
    `rank`: this engine's first worker's rank (1 + producer index). `in_group=False` (restarted or added
    later): skip broadcasts until a re-formed group lists `name`. `reform_timeout_s` (None: `timeout_s`) bounds
    joining a re-formed group, seconds."""

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
        # generation of the group this engine is in (WeightGroup.generation); None: none
        self.generation: int | None = 0 if in_group else None
        self._joined_port: int | None = port if in_group else None
        self.expects_resend = False  # joined a re-formed group; its first send (a resend) is still to come

    async def join(self) -> None:
        """Join the trainer's group (blocks until every rank is there) if `in_group`."""
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
        """Leave the old group; if `msg` lists this producer, `ack` and join as `msg.rank_of(name)` (blocks).
        Returns whether it is in the new group. A failed join is logged, not raised (the trainer re-forms without
        it; filesystem announcements meanwhile); a group listing it nowhere makes it ask like a newcomer."""
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
        """Outside every group and never told which to be in (restarted, late or scaled up)."""
        return not self.in_group and self.generation is None

    def must_apply(self, msg: Any, current_version: int) -> bool:
        """The first broadcast into a group just joined: every rank must take part."""
        return self.in_group and self.expects_resend and msg.method == self.method

    def lost_group(self) -> bool:
        """An engine on inference servers whose server is back outside the group (`ServerEngine.weight_group`
        "out": restarted) leaves it here too, and asks to join like a newcomer (once)."""
        if self.in_group and getattr(self.engine, "weight_group", "in") == "out":
            self.in_group, self.generation, self.expects_resend = False, None, False
            return True
        return False

    def skip_reason(self, msg: Any, current_version: int) -> str | None:
        """Not in the group, or an older version outside a resend (a collective nobody sends would block), or the
        engine's server restarting outside the group (`lost_group`)."""
        self.lost_group()
        if self.in_group and getattr(self.engine, "weight_group", "in") != "in":
            return "its inference server is restarting outside the weight group"
        if not self.in_group:
            return "not in the weight group"
        if msg.version < current_version and not self.expects_resend:
            return "older than the current version, not sent to the group again"
        return None

    async def apply(self, msg: Any) -> None:
        """Receive `msg.version` by broadcast (`RolloutEngine.update_weights`)."""
        await self.engine.update_weights(msg.version, msg.manifest, resend=self.expects_resend)
        self.expects_resend = False
