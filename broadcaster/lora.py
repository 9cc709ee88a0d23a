"""Receiver side of a "lora" weight payload: full weights from the base weights loaded at start + the adapter.

    W = W_base + (B @ A) * scaling      # Hu et al. 2021, "LoRA", eq. 3; peft's scaling = lora_alpha / r

computed as peft's `LoraLayer.get_delta_weight` on the trainer, in at least float32, so both sides hold identical
weights; the worker extension then casts to the engine's dtype, as a full payload would carry. The payload is
absolute (never a diff). `merged_weights` yields EVERY base tensor: vLLM's layer-wise reload needs all shards of a
fused layer (`qkv_proj`, `gate_up_proj`) at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from broadcaster.manifest import LORA_A_SUFFIX, LORA_B_SUFFIX, LORA_SCALING_SUFFIX, is_lora_entry, lora_modules


def merge_lora_delta(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor | float
) -> torch.Tensor:
    """`W_base + (B @ A) * scaling` (LoRA, Hu et al. 2021, eq. 3; peft's merge).
    `base` `[out, in]`, `lora_a` `[r, in]`, `lora_b` `[out, r]`, `scaling` peft's (alpha / r; rsLoRA alpha / sqrt(r)).
    Returns `[out, in]` in `lora_b`'s dtype promoted to at least float32, on its device. ValueError: shapes do not
    chain."""
    if (
        lora_a.dim() != 2
        or lora_b.dim() != 2
        or lora_b.shape[1] != lora_a.shape[0]
        or tuple(base.shape) != (lora_b.shape[0], lora_a.shape[1])
    ):
        raise ValueError(
            f"LoRA merge: base {list(base.shape)}, lora_A {list(lora_a.shape)}, lora_B {list(lora_b.shape)} "
            "do not chain; need base [out, in], lora_A [r, in], lora_B [out, r]"
        )
    dtype = torch.promote_types(lora_b.dtype, torch.float32)
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    if isinstance(scaling, torch.Tensor):
        scaling = scaling.to(dtype)
    base = base.to(device=lora_b.device, dtype=dtype)
    return base + (lora_b @ lora_a) * scaling


def merged_weights(
    base: Mapping[str, torch.Tensor], payload: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every `base` entry in order: the payload's whole tensor, a merge, or the base one.
    Raises ValueError before yielding anything (never half-loads): a payload name or shape the base lacks."""
    names = [[name, "float32", list(t.shape)] for name, t in payload.items()]
    modules = lora_modules(names)
    whole = {name: t for name, t in payload.items() if not is_lora_entry(name)}
    unknown = sorted({f"{m}.weight" for m in modules} - set(base)) + sorted(set(whole) - set(base))
    if unknown:
        raise ValueError(
            f"LoRA payload names {unknown[:5]} (of {len(unknown)}) are not weights of the base model; "
            "the producer must serve the checkpoint the trainer's base was loaded from"
        )
    adapted = {f"{m}.weight": m for m in modules}
    for name, m in adapted.items():  # shapes checked before anything is yielded
        a, b = payload[m + LORA_A_SUFFIX], payload[m + LORA_B_SUFFIX]
        if tuple(base[name].shape) != (b.shape[0], a.shape[1]):
            raise ValueError(
                f"LoRA payload for {m!r} makes [{b.shape[0]}, {a.shape[1]}], base {name!r} is "
                f"{list(base[name].shape)}; the producer must serve the trainer's base checkpoint"
            )

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in base.items():
            if name in whole:
                yield name, whole[name]
            elif name in adapted:
                m = adapted[name]
                yield (
                    name,
                    merge_lora_delta(
                        tensor, payload[m + LORA_A_SUFFIX], payload[m + LORA_B_SUFFIX], payload[m + LORA_SCALING_SUFFIX]
                    ),
                )
            else:
                yield name, tensor

    return weights()
