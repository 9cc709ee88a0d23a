"""vLLM worker extension (`worker_extension_cls`) that receives policy weights inside each vLLM worker.
Reached by `collective_rpc` (plain values only; the repo must be importable in vLLM's children). Three ways in:
`init_weight_group` + `receive_weights` (broadcast; `destroy_weight_group` on a re-form), `receive_weights_bus`
(`broadcaster.bus_fetch`) and `load_weights_from_path` (filesystem); the first two share one `BucketReceiver`. A
"lora" payload is merged into base weights read once from the engine's checkpoint and kept on CPU (why not vLLM's
native LoRA: docs/ARCHITECTURE.md, "Weights"). Floating tensors are cast to the engine's dtype, then loaded by
`reload_weights` (the layer-wise path: on CPU, linear weights are repacked into oneDNN and their Parameters
emptied); a tied lm_head is re-dispatched on CPU. Callers pause with `clear_cache=True` (the prefix cache is in the
EngineCore). Attributes are prefixed `_rlbus_`: vLLM refuses names that clash with the Worker's.
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
    """Methods mixed into vLLM's Worker (`self` has `device`, `rank`, `model_runner`, `vllm_config`)."""

    def init_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float | None = None,
    ) -> None:
        """Join the trainer's group as `rank + i` (worker `i`; `world_size` counts every worker + 1); blocks.
        `timeout_s` bounds the wait (None: torch's default). ValueError: a bad backend or rank."""
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
        """Leave the weight group (idempotent; the trainer re-formed it); the receive buffers are kept."""
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
        """Receive the broadcast of `manifest` (blocks until every bucket is in) and apply it."""
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
        """Fetch `version` (or the newer latest) from `address` and apply it; TimeoutError after `timeout_s`.
        Returns `{"version": loaded, "rejected": {reason: n}, "num_bytes", "num_buckets"}`."""
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
        """Cast to the engine's dtype, `reload_weights`, re-dispatch a tied lm_head on CPU."""
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
    """Floating tensors cast to `dtype` one at a time (merged LoRA is float32; vLLM would warn per tensor)."""
    for name, tensor in weights:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
