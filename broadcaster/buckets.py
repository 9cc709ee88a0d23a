"""Receive side of the weight broadcast: one manifest's buckets into flat buffers allocated once.

Used by every receiver, so they all decode the wire exactly alike: the producers' vLLM worker
extension (`broadcaster.worker_extension`), the bus method's fetcher (`broadcaster.bus_fetch`),
the broadcaster tests and `bench/broadcast.py`.

Invariants:
- The buffers are allocated once per (manifest, bucket_bytes) and reused for every version: a
  new receiver is needed only if the manifest changes (it does not during a run).
- `receive` posts every bucket's broadcast at once, in manifest order, then waits for all, as the
  sender issues them (the backend matches collectives by issue order).
- The returned views alias the buffers: they are valid until the next `receive`, so a caller
  must consume (load / copy) them before receiving again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from broadcaster.manifest import DEFAULT_BUCKET_BYTES, bucket_views, plan_buckets


class BucketReceiver:
    """Flat receive buffers for one manifest (see the module docstring).

    Args:
        manifest: `[[name, dtype, shape], ...]` as announced (`broadcaster.manifest`).
        bucket_bytes: the sender's bucket size.
        device: where to receive (CPU for gloo, the worker's GPU for nccl).

    Raises:
        ValueError: a malformed manifest or bucket size (`plan_buckets`).
    """

    def __init__(
        self, manifest: Sequence[Sequence], bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str = "cpu"
    ) -> None:
        self.key = (repr(manifest), int(bucket_bytes))
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = plan_buckets(manifest, bucket_bytes)
        self.flats = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in self.buckets]
        self._views = {
            name: view
            for bucket, flat in zip(self.buckets, self.flats, strict=True)
            for name, view in bucket_views(bucket, flat)
        }
        self.num_bytes = sum(f.numel() * f.element_size() for f in self.flats)

    def matches(self, manifest: Sequence[Sequence], bucket_bytes: int) -> bool:
        """Whether these buffers were planned for this manifest and bucket size."""
        return self.key == (repr(manifest), int(bucket_bytes))

    def views(self) -> dict[str, torch.Tensor]:
        """`{name: view}` of every manifest entry in manifest order (aliasing the buffers)."""
        return dict(self._views)

    def receive(self, group, src: int = 0) -> dict[str, torch.Tensor]:
        """Receive one version from rank `src` of `group` (a torch.distributed ProcessGroup);
        returns `{name: view}` in manifest order (views alias the buffers, see the docstring).

        Raises:
            RuntimeError: the collective failed or timed out (torch.distributed errors).
        """
        works = [group.broadcast(flat, src) for flat in self.flats]
        for work in works:
            work.wait()
        return self.views()
