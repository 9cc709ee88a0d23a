"""Receive side of the weight transfer: one manifest's buckets into flat buffers allocated once.
Every receiver uses it (the vLLM worker extension, `broadcaster.bus_fetch`, tests, `bench/broadcast.py`), so all
decode the wire alike. Buffers are reused for every version of one (manifest, bucket_bytes). `receive` posts every
bucket's broadcast in manifest order, then waits (collectives match by issue order). Returned views alias the
buffers: valid until the next `receive`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from broadcaster.manifest import DEFAULT_BUCKET_BYTES, bucket_views, plan_buckets


class BucketReceiver:
    """Flat receive buffers for `manifest` (`[[name, dtype, shape], ...]`) at the sender's `bucket_bytes`.
    `device`: CPU for gloo, the worker's GPU for nccl. Raises ValueError: a malformed manifest or bucket size."""

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
        """Receive one version from rank `src` of `group`; `{name: view}` aliasing the buffers.
        Raises RuntimeError: the collective failed or timed out."""
        works = [group.broadcast(flat, src) for flat in self.flats]
        for work in works:
            work.wait()
        return self.views()
