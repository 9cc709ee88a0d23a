"""Trainer side of the weight sync: send the policy's weights to every producer's vLLM engine.

    trainer (rank 0)                                       producer engines (ranks 1..world_size-1)
    WeightBroadcaster.init_group()      <--- rendezvous --->  RolloutEngine.init_weight_group(...)
    WeightBroadcaster.start_send(sd, v) ---- broadcast --->  RolloutEngine.update_weights(v, manifest)
      ... trainer trains while bytes move ...
    WeightBroadcaster.wait()            (before the next start_send; raises SendFailed)
      (or method="filesystem": out_dir/v{v}/ + READY)        RolloutEngine.load_weights_from_path(v, p)

Methods:
- "broadcast": torch.distributed broadcast over a stateless group (vLLM's
  `stateless_init_torch_distributed_process_group`, so vLLM must be importable here too): gloo on
  CPU, nccl on CUDA ("auto" picks nccl iff CUDA is available), same code. Tensors go in buckets
  (`broadcaster.manifest.plan_buckets`) through flat send buffers allocated once and reused.
- "filesystem": `out_dir/v{version}/model.safetensors` + a READY marker written last (synchronous).

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

Ordering: `start_send` is a collective for the broadcast method. Announce `weights.ready(version,
manifest)` first (the caller's job), then call it; producers call
`RolloutEngine.update_weights(version, manifest)` on the announcement. The manifest of one payload
never changes during a run, so the buffers are allocated once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch

from broadcaster.filesystem import prune_versions, write_version
from broadcaster.manifest import (
    DEFAULT_BUCKET_BYTES,
    build_manifest,
    bucket_views,
    manifest_num_bytes,
    plan_buckets,
)

logger = logging.getLogger(__name__)

Method = Literal["broadcast", "filesystem"]
Backend = Literal["auto", "gloo", "nccl"]

_POLL_S = 0.001
"""How often `wait` polls nccl work (whose wait() does not block the host), seconds."""


def resolve_backend(backend: Backend) -> Literal["gloo", "nccl"]:
    """"auto" -> nccl if CUDA is available else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


class SendFailed(RuntimeError):
    """A background weight transfer failed (a producer died, a gloo/nccl error or timeout).

    Attributes:
        version: the policy version whose transfer failed.
        payload: `{name: tensor}` that version's payload (views of the send buffers, kept alive by
            this exception), so it can be re-published another way.
    """

    def __init__(self, version: int, payload: dict[str, torch.Tensor], cause: BaseException) -> None:
        super().__init__(f"broadcast of weights version {version} failed: {type(cause).__name__}: {cause}")
        self.version = version
        self.payload = payload


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
class _SendBuffers:
    """The flat send buffers of one manifest, with per bucket its names and views into them."""

    manifest: list[list]
    flats: list[torch.Tensor]
    names: list[list[str]]
    views: list[list[torch.Tensor]]
    payload: dict[str, torch.Tensor]
    num_bytes: int

    @classmethod
    def allocate(cls, manifest: list[list], bucket_bytes: int, device: torch.device) -> "_SendBuffers":
        buckets = plan_buckets(manifest, bucket_bytes)
        flats = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in buckets]
        per_bucket = [bucket_views(b, f) for b, f in zip(buckets, flats, strict=True)]
        return cls(manifest, flats, [[n for n, _ in entries] for entries in per_bucket],
                   [[v for _, v in entries] for entries in per_bucket],
                   {n: v for entries in per_bucket for n, v in entries}, manifest_num_bytes(manifest))


class WeightBroadcaster:
    """Rank 0 of the weight group (broadcast) or the writer of version directories (filesystem).

    Args:
        method: "broadcast" or "filesystem".
        backend: "auto" | "gloo" | "nccl" (broadcast only).
        host, port: where rank 0 hosts the rendezvous store; producers connect there.
        world_size: 1 (this trainer) + the number of producer workers.
        out_dir: root of version directories (filesystem only).
        bucket_bytes: bucket size; producers must use the same (the default on both sides).
        timeout_s: bound on rendezvous and each collective (None: torch's default, 30 min gloo).
        keep_versions: filesystem only; older complete version directories are deleted.
    """

    def __init__(
        self,
        method: Method = "broadcast",
        backend: Backend = "auto",
        host: str = "127.0.0.1",
        port: int = 29555,
        world_size: int = 2,
        out_dir: str | Path | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float | None = None,
        keep_versions: int | None = 2,
    ) -> None:
        if method not in ("broadcast", "filesystem"):
            raise ValueError(f"method must be 'broadcast' or 'filesystem', got {method!r}")
        if method == "broadcast" and world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + producers), got {world_size}")
        if method == "filesystem" and out_dir is None:
            raise ValueError("method='filesystem' needs out_dir")
        if keep_versions is not None and keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1 or None, got {keep_versions}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.method = method
        self.backend = resolve_backend(backend) if method == "broadcast" else None
        self.host, self.port, self.world_size = host, port, world_size
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.keep_versions = keep_versions
        self._group = None
        self._send_buffers: _SendBuffers | None = None
        self._pending: _Transfer | None = None
        self.last_transfer: dict | None = None
        """Info of the last completed transfer (`start_send`'s dict + `transfer_s`), or None."""

    # -- lifecycle -------------------------------------------------------------------------------

    def init_group(self) -> None:
        """Create the group as rank 0; blocks until all `world_size - 1` producer workers joined.

        No-op for the filesystem method. Producers call `RolloutEngine.init_weight_group` in any
        order relative to this, as long as all of them do within `timeout_s`.
        """
        if self.method != "broadcast" or self._group is not None:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
        start = time.perf_counter()
        self._group = stateless_init_torch_distributed_process_group(
            self.host, self.port, 0, self.world_size, backend=self.backend, timeout=timeout
        )
        logger.info("weight group %s:%d up, world_size %d (%s), %.2f s", self.host, self.port,
                    self.world_size, self.backend, time.perf_counter() - start)

    def close(self) -> None:
        """Wait for an in-flight transfer (its collectives time out after `timeout_s`), tear the
        group down and release the send buffers (idempotent; a failed transfer is logged)."""
        if self._pending is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - best effort at shutdown; peers may be gone
                logger.warning("weight transfer in flight at close failed", exc_info=True)
            self._pending = None
        if self._group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            try:
                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception:  # noqa: BLE001 - best effort at shutdown; peers may be gone
                logger.warning("weight group teardown failed", exc_info=True)
            self._group = None
        self._send_buffers = None

    # -- sending ---------------------------------------------------------------------------------

    @staticmethod
    def manifest(state_dict: Mapping[str, torch.Tensor]) -> list[list]:
        """`[[hf_name, dtype, shape], ...]` in broadcast order (see `broadcaster.manifest`)."""
        return build_manifest(state_dict)

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
    def start_send(self, state_dict: Mapping[str, torch.Tensor], version: int,
                   manifest: list[list] | None = None) -> dict:
        """Start sending `state_dict` as policy `version`; returns what to announce.

        `manifest`: `self.manifest(state_dict)` if the caller already built it (to announce it),
        else built here.

        Returns `{"method", "version", "manifest", "path", "num_bytes", "bucket_bytes",
        "blocked_s"}`: `path` is the version directory (filesystem) or None (broadcast);
        `blocked_s` the seconds this call took (waiting for the previous transfer, copying into
        the send buffers, handing the buckets to the backend). Broadcast: the transfer goes on in
        the background (see the module docstring); `state_dict` may change once this returns.
        Filesystem: written synchronously.

        Raises:
            SendFailed: the PREVIOUS transfer failed (nothing of this version was sent).
            RuntimeError: no group (`init_group` first), or the backend refused the collective.
            ValueError: a bad payload (`build_manifest`).
        """
        start = time.perf_counter()
        manifest = self.manifest(state_dict) if manifest is None else manifest
        info = {"method": self.method, "version": version, "manifest": manifest, "path": None,
                "num_bytes": 0, "bucket_bytes": self.bucket_bytes}
        if self.method == "filesystem":
            assert self.out_dir is not None
            directory, info["num_bytes"] = write_version(self.out_dir, version, state_dict, manifest)
            info["path"] = str(directory)
            if self.keep_versions is not None:
                prune_versions(self.out_dir, self.keep_versions)
            info["blocked_s"] = time.perf_counter() - start
            return info
        if self._group is None:
            raise RuntimeError("send() before init_group()")
        self.wait()  # the previous transfer must be done before its buffers are refilled
        buffers = self._buffers(manifest)
        info["num_bytes"] = buffers.num_bytes
        works = []
        issued_at = None
        for flat, names, views in zip(buffers.flats, buffers.names, buffers.views, strict=True):
            torch._foreach_copy_(views, [state_dict[name].detach() for name in names])  # one dispatch per bucket
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

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict:
        """Send `state_dict` as policy `version` and wait until it is out (`start_send` + `wait`).

        Returns `start_send`'s dict plus `send_time_s` (the whole call) and, for the broadcast
        method, `transfer_s`. Raises as `start_send`, and `SendFailed` for this version too.
        """
        start = time.perf_counter()
        info = self.start_send(state_dict, version)
        done = self.wait() if self.method == "broadcast" else None
        return {**info, **(done or {}), "send_time_s": time.perf_counter() - start}

    def _buffers(self, manifest: list[list]) -> _SendBuffers:
        """The send buffers of `manifest` (allocated and planned on its first send, then reused)."""
        if self._send_buffers is None or self._send_buffers.manifest != manifest:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if self.backend == "nccl" else torch.device("cpu")
            self._send_buffers = _SendBuffers.allocate(manifest, self.bucket_bytes, device)
        return self._send_buffers
