"""A weight-group producer (rank 1 of a gloo group) in its own process, as a vLLM worker is.

Tests used to form both ranks from threads of the pytest process. torch builds the rank-0
TCPStore server and the rank-1 client concurrently there (the server's constructor waits for the
client), and once in CI that crashed the whole test run with a segmentation fault inside
``torch.distributed.rendezvous._create_c10d_store``. Across processes, as in production, the two
never share an address space.
"""

from __future__ import annotations

import io
import multiprocessing
import traceback
from collections.abc import Sequence
from typing import Any

import torch

JOIN_TIMEOUT_S = 60.0

SPAWN = multiprocessing.get_context("spawn")
"""The start method of every test process that forms gloo ranks (a fresh interpreter each)."""


def tensors_to_bytes(tensors: Any) -> bytes:
    """``tensors`` (dicts / lists of tensors, any dtype, bfloat16 included) as bytes for a queue
    between processes; :func:`tensors_from_bytes` reads them back."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def tensors_from_bytes(payload: bytes) -> Any:
    """What :func:`tensors_to_bytes` wrote."""
    return torch.load(io.BytesIO(payload))


def _receive(
    port: int, manifest: Sequence[Sequence], bucket_bytes: int | None, versions: int, go: Any
) -> list[dict[str, torch.Tensor]]:
    from vllm.distributed.utils import (
        stateless_destroy_torch_distributed_process_group,
        stateless_init_torch_distributed_process_group,
    )

    from broadcaster.buckets import BucketReceiver

    group = stateless_init_torch_distributed_process_group("127.0.0.1", port, 1, 2, backend="gloo")
    if go is not None and not go.wait(JOIN_TIMEOUT_S):
        raise TimeoutError(f"the test did not release the producer within {JOIN_TIMEOUT_S} s")
    buffers = BucketReceiver(manifest) if bucket_bytes is None else BucketReceiver(manifest, bucket_bytes)
    received = [{name: view.clone() for name, view in buffers.receive(group).items()} for _ in range(versions)]
    stateless_destroy_torch_distributed_process_group(group)
    return received


def _main(out: Any, args: tuple) -> None:
    try:
        out.put(("ok", tensors_to_bytes(_receive(*args))))
    except BaseException:
        out.put(("error", traceback.format_exc()))


class WeightPeer:
    """Rank 1 of the gloo weight group at ``127.0.0.1:port``, in a spawned process.

    It joins the group, waits for ``go`` (a ``WeightPeer.event()``) when one is given, receives
    ``versions`` broadcasts through the vLLM worker extension's ``BucketReceiver`` (the
    manifest's buckets of ``bucket_bytes``, the default when None), tears the group down and exits.
    ``versions=0`` joins and leaves, as a producer that dies.
    """

    def __init__(
        self,
        port: int,
        manifest: Sequence[Sequence],
        *,
        bucket_bytes: int | None = None,
        versions: int = 1,
        go: Any = None,
    ) -> None:
        self._out = SPAWN.Queue()
        self._proc = SPAWN.Process(
            target=_main, daemon=True, args=(self._out, (port, list(manifest), bucket_bytes, versions, go))
        )
        self._proc.start()

    @classmethod
    def event(cls) -> Any:
        """A cross-process event to hand to ``go``."""
        return SPAWN.Event()

    def result(self, timeout_s: float = JOIN_TIMEOUT_S) -> list[dict[str, torch.Tensor]]:
        """One dict per received version (name -> tensor, manifest order).

        Raises:
            AssertionError: the peer failed (its traceback in the message) or did not report
                within ``timeout_s`` seconds.
        """
        try:
            status, payload = self._out.get(timeout=timeout_s)
        except Exception as exc:  # queue.Empty
            raise AssertionError(f"weight peer reported nothing within {timeout_s} s") from exc
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        assert status == "ok", f"weight peer failed:\n{payload}"
        return tensors_from_bytes(payload)

    def kill(self) -> None:
        """Stop the peer if it still runs (for ``finally`` blocks)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)
