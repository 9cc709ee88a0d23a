"""Receiver side of a "lora" weight payload: rebuild full weights from base weights + adapter.

A LoRA policy trains only the low-rank factors, so the trainer sends only them (plus any whole
tensors it chose to send, e.g. noisy RMSNorm weights; see `broadcaster.manifest`). A producer keeps
the base weights it loaded at start (the same checkpoint the trainer's frozen base came from) and
rebuilds each adapted weight as

    W = W_base + (B @ A) * scaling                    # Hu et al. 2021, "LoRA", eq. 3 (h = W0 x + B A x),
                                                     # with peft's scaling = lora_alpha / r

computed exactly as peft's `LoraLayer.get_delta_weight` (+ `policy_state_dict`'s `W + delta`) does
on the trainer, so both sides hold bit-identical float32 weights. The merge runs in (at least)
float32 whatever the dtypes it gets (a bfloat16 checkpoint's base weights are widened exactly);
the worker extension then casts the merged weight to the engine's dtype (`producers.dtype`), which
is what the trainer's full payload of the same version would carry: `dtype(W + (B @ A) * scaling)`.

Invariants:
- The payload is absolute: it never depends on the previous version the producer applied.
- `merged_weights` yields EVERY base tensor (replaced or rebuilt where the payload says so): vLLM's
  layer-wise reload needs all shards of a fused layer (`qkv_proj`, `gate_up_proj`) in one reload,
  otherwise the shards it did not get are left uninitialised.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from broadcaster.manifest import LORA_A_SUFFIX, LORA_B_SUFFIX, LORA_SCALING_SUFFIX, is_lora_entry, lora_modules


def merge_lora_delta(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor | float
) -> torch.Tensor:
    """`W_base + (B @ A) * scaling`: one adapted weight (LoRA, Hu et al. 2021, eq. 3; peft's merge).

    Args:
        base: `[out, in]` base weight (any float dtype; widened to the merge dtype, as the
            trainer loads its base in float32).
        lora_a: `[r, in]` down projection A.
        lora_b: `[out, r]` up projection B.
        scaling: 0-dim tensor or float, peft's `scaling[adapter]` (lora_alpha / r, or
            lora_alpha / sqrt(r) with rsLoRA).

    Returns: `[out, in]` tensor of the merge dtype (`lora_b`'s dtype, at least float32: float64
        factors stay float64), on `lora_b`'s device.

    Raises:
        ValueError: shapes do not chain (`[out, r] @ [r, in]` must equal `base`'s shape).
    """
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
    """Full weights from `base` (HF names) and a "lora" `payload` (`broadcaster.manifest` names).

    Returns an iterator of `(hf_name, tensor)` for every entry of `base`, in its order: the payload's whole tensor
    where it sends one under that name, `merge_lora_delta` for `M.weight` of an adapted module
    `M`, else the base tensor itself.

    Raises (at once, before the iterator yields anything, so a bad payload never half-loads):
        ValueError: the payload adapts a module whose `M.weight` is not in `base` or has another
            shape, or sends a whole tensor `base` does not have (the producer's model is not the
            trainer's base).
    """
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
