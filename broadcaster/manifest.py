"""The weight manifest, the contract between the trainer's senders and the producers' vLLM workers:

    manifest = [[hf_param_name: str, dtype: str, shape: list[int]], ...]   # send order; dtype e.g. "bfloat16"

A plain list (travels in a msgpack header or a `collective_rpc` argument). `dtype` is the wire dtype, maybe
narrower than the sender's tensor (cast on the way). Names are HF checkpoint names; a tied alias appears once, as
`save_pretrained` writes it. Payload kinds (`payload_kind`): "full" (whole weights) or "lora": per adapted module
`M`, `M.lora_A.weight` `[r, in]`, `M.lora_B.weight` `[out, r]`, `M.lora_scaling` `[]`, merged by `broadcaster.lora`;
other entries replace their base tensor (noisy RMSNorm). Always absolute, never a diff. `plan_buckets` is
deterministic on both sides: runs of consecutive same-dtype entries within `bucket_bytes` (a bigger tensor alone),
each sent as ONE flat 1-D tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

#: Default bucket size, the same on both sides (not sent). 32 MiB: copying bucket k+1 overlaps sending bucket k
#: (400 MB: ~1.4x -> ~1x a raw gloo broadcast vs 256 MiB, bench/broadcast.py), per-collective cost negligible.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024

#: Suffixes of the three entries of one adapted module in a "lora" payload (see the docstring).
LORA_A_SUFFIX = ".lora_A.weight"
LORA_B_SUFFIX = ".lora_B.weight"
LORA_SCALING_SUFFIX = ".lora_scaling"
_LORA_SUFFIXES = (LORA_A_SUFFIX, LORA_B_SUFFIX, LORA_SCALING_SUFFIX)

#: Name fragments that mean a raw PEFT state dict was passed (adapter names with an adapter
#: segment such as `lora_A.default.weight`, the `base_model.model.` prefix, wrapped base layers).
_PEFT_MARKERS = re.compile(r"lora_A|lora_B|lora_embedding|base_model\.model\.|\.base_layer\.")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """`"float32"` -> `torch.float32`; raises ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight manifest")
    return dtype


def is_lora_entry(name: str) -> bool:
    """Whether `name` is one of the three entries of an adapted module in a "lora" payload."""
    return name.endswith(_LORA_SUFFIXES) and "base_model.model." not in name


def build_manifest(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[list]:
    """The manifest of an HF `state_dict()` or a "lora" payload, in iteration order, aliases dropped.
    `dtype`: wire dtype of floating entries (None: their own); LoRA factors keep theirs (~1% of the bytes, merged
    unrounded so the result equals a full payload's). Raises ValueError: a raw PEFT name, or a "lora" module
    lacking an entry; TypeError: a value that is not a Tensor."""
    manifest: list[list] = []
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, tensor in state_dict.items():
        if _PEFT_MARKERS.search(name) and not is_lora_entry(name):
            raise ValueError(
                f"state dict entry {name!r} looks like an unmerged PEFT/LoRA parameter; "
                "pass the merged full weights with Hugging Face names, or the adapter payload of "
                "trainer.state.model.lora_adapter_state_dict, instead"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is {type(tensor).__name__}, not a Tensor")
        # Same first element, shape and dtype == the same parameter (tied embeddings).
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        wire = dtype if dtype is not None and tensor.is_floating_point() and not is_lora_entry(name) else tensor.dtype
        manifest.append([name, dtype_name(wire), list(tensor.shape)])
    if payload_kind(manifest) == "lora":
        lora_modules(manifest)  # validates the adapter entries
    return manifest


def payload_kind(manifest: Sequence[Sequence]) -> str:
    """ "lora" if the manifest carries adapter entries (see the module docstring), else "full"."""
    return "lora" if any(is_lora_entry(str(item[0])) for item in manifest) else "full"


def lora_modules(manifest: Sequence[Sequence]) -> dict[str, tuple[int, int, int]]:
    """`{hf_module_name: (out_features, rank, in_features)}`; ValueError: a missing entry or disagreeing shapes."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, _, shape in manifest:
        for suffix in _LORA_SUFFIXES:
            if is_lora_entry(name) and name.endswith(suffix):
                shapes.setdefault(name[: -len(suffix)], {})[suffix] = tuple(int(s) for s in shape)
    modules: dict[str, tuple[int, int, int]] = {}
    for module, parts in shapes.items():
        if set(parts) != set(_LORA_SUFFIXES):
            missing = sorted(set(_LORA_SUFFIXES) - set(parts))
            raise ValueError(f"LoRA payload: module {module!r} lacks {missing}; send all three entries per module")
        a, b, scaling = parts[LORA_A_SUFFIX], parts[LORA_B_SUFFIX], parts[LORA_SCALING_SUFFIX]
        if len(a) != 2 or len(b) != 2 or b[1] != a[0] or scaling != ():
            raise ValueError(
                f"LoRA payload: module {module!r} has lora_A {list(a)}, lora_B {list(b)}, scaling {list(scaling)}; "
                "need lora_A [r, in], lora_B [out, r] and a 0-dim scaling"
            )
        modules[module] = (b[0], a[0], a[1])
    return modules


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
        item_size = dtype.itemsize
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
    return [(e.name, flat[e.offset : e.offset + e.numel].view(e.shape)) for e in bucket.entries]


def manifest_num_bytes(manifest: Sequence[Sequence]) -> int:
    """Total payload size of the manifest in bytes."""
    return sum(prod(int(s) for s in shape) * parse_dtype(dtype).itemsize for _, dtype, shape in manifest)
