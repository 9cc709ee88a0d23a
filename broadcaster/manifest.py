"""The weight manifest: what the trainer broadcasts, in which order, in which buckets.

The manifest is the whole contract between the trainer (`broadcaster.WeightBroadcaster`) and the
producers' vLLM workers (`producers.weight_sync.WeightSyncExtension`). It is a plain list, so it
travels in a msgpack header or a `collective_rpc` argument unchanged:

    manifest = [[hf_param_name: str, dtype: str, shape: list[int]], ...]   # broadcast order

`dtype` is the torch dtype's name without the `torch.` prefix ("float32", "bfloat16", ...).

Invariants:
- Names are Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj.weight`), i.e. what
  `save_pretrained` would write. vLLM's `load_weights` maps them to its own fused layout.
- Aliased tensors (tied `lm_head.weight` == `model.embed_tokens.weight`) appear once, under the
  first name in state-dict order, exactly as `save_pretrained` drops the tie.
- Both sides derive the buckets from the manifest with `plan_buckets(manifest, bucket_bytes)`,
  which is deterministic: one bucket = a run of consecutive same-dtype entries whose total size
  stays within `bucket_bytes` (a bigger single tensor gets a bucket of its own). Each bucket is sent
  as ONE flat 1-D tensor, so a 300-tensor model costs a handful of collectives, not 300.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

#: Default bucket size; both sides must use the same value (it is not sent on the wire).
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024

#: Name fragments that mean an unmerged PEFT model was passed instead of merged HF weights.
_PEFT_MARKERS = ("lora_A", "lora_B", "lora_embedding", "base_model.model.", ".base_layer.")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """`"float32"` -> `torch.float32`; raises ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight manifest")
    return dtype


def build_manifest(state_dict: Mapping[str, torch.Tensor]) -> list[list]:
    """The manifest of an HF `state_dict()`, in its iteration order, aliases dropped.

    Raises ValueError for PEFT adapter names: pass the MERGED full weights with HF names
    (e.g. `peft_model.merge_and_unload().state_dict()` on a copy, or an equivalent merge) so vLLM
    receives plain weights.
    """
    manifest: list[list] = []
    seen: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
    for name, tensor in state_dict.items():
        if any(marker in name for marker in _PEFT_MARKERS):
            raise ValueError(
                f"state dict entry {name!r} looks like an unmerged PEFT/LoRA parameter; "
                "pass the merged full weights with Hugging Face names instead"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is {type(tensor).__name__}, not a Tensor")
        # Same storage, offset, shape and dtype == the same parameter (tied embeddings).
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        manifest.append([name, dtype_name(tensor.dtype), list(tensor.shape)])
    return manifest


@dataclass(frozen=True)
class BucketEntry:
    """One manifest entry inside a bucket: elements `[offset, offset + numel)` of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat 1-D tensor on the wire: `numel` elements of `dtype`."""

    dtype: torch.dtype
    numel: int
    entries: tuple[BucketEntry, ...]


def plan_buckets(manifest: Sequence[Sequence], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Split the manifest into buckets (see the module docstring); validates every entry."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    current_dtype: torch.dtype | None = None
    current_numel = 0

    def flush() -> None:
        nonlocal entries, current_numel
        if entries:
            assert current_dtype is not None
            buckets.append(Bucket(current_dtype, current_numel, tuple(entries)))
        entries, current_numel = [], 0

    for item in manifest:
        if len(item) != 3:
            raise ValueError(f"manifest entry must be [name, dtype, shape], got {item!r}")
        name, dtype_str, shape = item
        if not isinstance(name, str) or not isinstance(dtype_str, str):
            raise ValueError(f"bad manifest entry {item!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in manifest entry {item!r}")
        dtype = parse_dtype(dtype_str)
        numel = prod(shape)
        item_size = torch.empty((), dtype=dtype).element_size()
        if dtype != current_dtype or (current_numel + numel) * item_size > bucket_bytes:
            flush()
            current_dtype = dtype
        entries.append(BucketEntry(name, shape, current_numel, numel))
        current_numel += numel
    flush()
    return buckets


def bucket_views(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for each entry of `bucket`, viewing into its flat buffer `flat`."""
    assert flat.numel() == bucket.numel and flat.dtype == bucket.dtype
    return [(e.name, flat[e.offset:e.offset + e.numel].view(e.shape)) for e in bucket.entries]


def manifest_num_bytes(manifest: Sequence[Sequence]) -> int:
    """Total payload size of the manifest in bytes."""
    return sum(
        prod(int(s) for s in shape) * torch.empty((), dtype=parse_dtype(dtype)).element_size()
        for _, dtype, shape in manifest
    )
