"""vLLM worker extension that receives policy weights from the trainer.

vLLM mixes this class into its Worker (`worker_extension_cls=
"producers.weight_sync.WeightSyncExtension"`), so the methods below run inside each worker
process and are reached with `AsyncLLM.collective_rpc(name, args=...)`. The repository root must
be importable in vLLM's spawned children (it is when the producer runs from the repo or rlbus is
installed). Only plain values cross `collective_rpc`; tensors never do.

Two ways in:
- `init_weight_group` + `receive_weights`: a torch.distributed broadcast from the trainer (rank 0)
  over a group made with vLLM's `stateless_init_torch_distributed_process_group`: gloo on CPU,
  nccl on CUDA, same code. Buckets and their flat receive buffers follow
  `broadcaster.manifest.plan_buckets` and are allocated once per manifest, then reused.
- `load_weights_from_path`: read a safetensors file or directory (the filesystem fallback).

Both apply the weights with the worker's `reload_weights(weights_iterator=...)`, the layer-wise
reload lifecycle: on CPU, linear weights are repacked into oneDNN after loading and their
Parameters emptied, so `param.copy_()` / a bare `model.load_weights()` would fail or be ignored.
A tied lm_head keeps a stale packed copy after a reload on CPU, so it is re-dispatched.

Invariants:
- The scheduler's prefix cache lives in the EngineCore, out of a worker's reach: callers must pause
  with `clear_cache=True` around a call (what `producers.engine.RolloutEngine` does), otherwise
  cached KV computed by the old weights can be served after the update.
- Attribute names are prefixed `_rlbus_`: vLLM refuses an extension whose class attributes clash
  with the Worker's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch

from broadcaster.manifest import DEFAULT_BUCKET_BYTES, Bucket, bucket_views, plan_buckets

logger = logging.getLogger(__name__)


class WeightSyncExtension:
    """Methods mixed into vLLM's Worker; `self` is the Worker (has `device`, `rank`,
    `model_runner`, `vllm_config`, `reload_weights`)."""

    def init_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float | None = None,
    ) -> None:
        """Join the trainer's weight-broadcast group (the trainer is rank 0 and hosts the store).

        `rank` is the rank of this engine's first worker; worker `i` of a tensor-parallel engine
        joins as `rank + i` (so `world_size` counts every worker of every engine, plus 1).
        Blocks until all `world_size` ranks have joined (the trainer's `init_group` runs
        concurrently); `timeout_s` bounds the wait (None: torch's default for the backend).
        """
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        my_rank = rank + int(getattr(self, "rank", 0) or 0)
        if not 0 < my_rank < world_size:
            raise ValueError(f"worker rank {my_rank} outside 1..{world_size - 1}")
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._rlbus_group = stateless_init_torch_distributed_process_group(
            host, port, my_rank, world_size, backend=backend, timeout=timeout
        )
        # nccl receives straight into device memory; gloo works on host tensors.
        self._rlbus_device = self.device if backend == "nccl" else torch.device("cpu")
        self._rlbus_buffers = None
        logger.info("joined weight group %s:%d as rank %d/%d (%s)", host, port, my_rank,
                    world_size, backend)

    def receive_weights(self, manifest: list[list], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Receive the trainer's broadcast described by `manifest` and apply it.

        Blocks until rank 0 broadcasts every bucket (the trainer's `WeightBroadcaster.send`).
        """
        group = getattr(self, "_rlbus_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_group")
        key = (repr(manifest), bucket_bytes)
        cached = getattr(self, "_rlbus_buffers", None)
        if cached is None or cached[0] != key:
            buckets = plan_buckets(manifest, bucket_bytes)
            flats = [torch.empty(b.numel, dtype=b.dtype, device=self._rlbus_device)
                     for b in buckets]
            cached = self._rlbus_buffers = (key, buckets, flats)
        _, buckets, flats = cached
        for flat in flats:
            group.broadcast(flat, 0).wait()
        self._rlbus_apply(_iter_buckets(buckets, flats))

    def load_weights_from_path(self, path: str) -> None:
        """Load every tensor of a safetensors file, or of all `*.safetensors` in a directory."""
        from safetensors import safe_open

        root = Path(path)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"no safetensors weights at {path}")

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self._rlbus_apply(weights())

    def _rlbus_apply(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Reload through vLLM's layer-wise lifecycle, then re-dispatch a tied lm_head on CPU."""
        from vllm.platforms import current_platform

        start = time.perf_counter()
        self.reload_weights(weights_iterator=weights)
        model = self.model_runner.get_model()
        hf_config = self.vllm_config.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if (current_platform.is_cpu() and getattr(hf_config, "tie_word_embeddings", False)
                and lm_head is not None and hasattr(lm_head, "weight")):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        logger.info("applied weights in %.3f s", time.perf_counter() - start)


def _iter_buckets(buckets: list[Bucket], flats: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket, flat in zip(buckets, flats, strict=True):
        yield from bucket_views(bucket, flat)
