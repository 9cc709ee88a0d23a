"""Trainer side of the weight sync: send the policy's weights to every producer's vLLM engine.

    trainer (rank 0)                                   producer engines (ranks 1..world_size-1)
    WeightBroadcaster.init_group()  <--- rendezvous --->  RolloutEngine.init_weight_group(...)
    WeightBroadcaster.send(sd, v)   ---- broadcast --->  RolloutEngine.update_weights(v, manifest)
      (or method="filesystem": out_dir/v{v}/ + READY)    RolloutEngine.load_weights_from_path(v, p)

Methods:
- "broadcast": torch.distributed broadcast over a stateless group (vLLM's
  `stateless_init_torch_distributed_process_group`, so vLLM must be importable here too): gloo on
  CPU, nccl on CUDA ("auto" picks nccl iff CUDA is available), same code. Tensors go in buckets
  (`broadcaster.manifest.plan_buckets`) through flat send buffers allocated once and reused.
- "filesystem": `out_dir/v{version}/model.safetensors` + a READY marker written last.

What to pass as `state_dict`: a Hugging Face model's `state_dict()` with HF names. For a PEFT/LoRA
policy pass the MERGED full weights with HF names (no `base_model.model.` prefix, no `lora_A/B`):
vLLM then receives plain weights and needs no LoRA support. `manifest()` rejects unmerged names.

Ordering: `send` is a collective for the broadcast method. Announce `weights.ready(version,
manifest)` first (that is the caller's job; the returned dict holds what to announce), then call
`send`; it returns once every producer received every bucket. Producers call
`RolloutEngine.update_weights(version, manifest)` on the announcement. The manifest of one model
never changes, so a producer may also learn it once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
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


def resolve_backend(backend: Backend) -> Literal["gloo", "nccl"]:
    """"auto" -> nccl if CUDA is available else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


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
        self.method = method
        self.backend = resolve_backend(backend) if method == "broadcast" else None
        self.host, self.port, self.world_size = host, port, world_size
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.keep_versions = keep_versions
        self._group = None
        self._send_buffers: tuple[str, list, list[torch.Tensor]] | None = None

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
        """Tear the group down and release the send buffers (idempotent)."""
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

    @torch.no_grad()
    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict:
        """Send `state_dict` as policy `version`; returns what to announce.

        Returns `{"method", "version", "manifest", "path", "num_bytes", "send_time_s",
        "bucket_bytes"}`; `path` is the version directory (filesystem) or None (broadcast).
        Broadcast: a collective that blocks until every producer called `receive_weights`.
        """
        start = time.perf_counter()
        manifest = self.manifest(state_dict)
        path = None
        if self.method == "filesystem":
            assert self.out_dir is not None
            directory, num_bytes = write_version(self.out_dir, version, state_dict, manifest)
            path = str(directory)
            if self.keep_versions is not None:
                prune_versions(self.out_dir, self.keep_versions)
        else:
            if self._group is None:
                raise RuntimeError("send() before init_group()")
            num_bytes = manifest_num_bytes(manifest)
            self._broadcast(state_dict, manifest)
        return {
            "method": self.method,
            "version": version,
            "manifest": manifest,
            "path": path,
            "num_bytes": num_bytes,
            "send_time_s": time.perf_counter() - start,
            "bucket_bytes": self.bucket_bytes,
        }

    def _broadcast(self, state_dict: Mapping[str, torch.Tensor], manifest: list[list]) -> None:
        key = repr(manifest)
        if self._send_buffers is None or self._send_buffers[0] != key:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if self.backend == "nccl" else torch.device("cpu")
            buckets = plan_buckets(manifest, self.bucket_bytes)
            flats = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in buckets]
            self._send_buffers = (key, buckets, flats)
        _, buckets, flats = self._send_buffers
        # Fill bucket k+1 while bucket k is on the wire; each bucket has its own buffer.
        works = []
        for bucket, flat in zip(buckets, flats, strict=True):
            for name, view in bucket_views(bucket, flat):
                view.copy_(state_dict[name].detach())
            works.append(self._group.broadcast(flat, 0))
        for work in works:
            work.wait()
