"""FSDP2 for the trainer (``trainer.parallel: fsdp``): sharding the packed forward, activation
checkpointing, clipping over sharded gradients, sharded (DCP) checkpoints, and the weights gathered
one tensor at a time for the producers. Gradients are summed over ranks and reduce-scattered after
every micro-batch; every collective runs on every rank in the same order, the out-of-step ones
announced by the leader (GATHER, SAVE). Why: docs/ARCHITECTURE.md, "Data parallelism".
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from trainer.state.model import base_model

log = logging.getLogger(__name__)

__all__ = [
    "SHARDED_DIR",
    "GatheredWeights",
    "clip_grad_norm",
    "enable_activation_checkpointing",
    "full_entry",
    "is_sharded",
    "load_sharded",
    "read_sharded_policy",
    "save_sharded",
    "shard_keeping_optimizer_state",
    "shard_policy",
    "weight_entries",
]

SHARDED_DIR = "sharded"
"""Subdirectory of a checkpoint holding the DCP files of model + optimizer (fsdp runs)."""


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 DTensors (``trainer.parallel: fsdp`` in force)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward (``trainer.activation_checkpointing``):
    transformers' non-reentrant checkpointing, under the forward's attention implementation.
    Raises ValueError if the model does not support it."""
    hf = base_model(model)
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(hf).__name__} does not support activation checkpointing; "
            "set trainer.activation_checkpointing: false"
        )

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # called at forward time: the recomputation in the backward runs under the attention
        # implementation of the forward (the packed varlen one is switched on for the forward only)
        return contextlib.nullcontext(), _attention_implementation(hf, hf.config._attn_implementation)

    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": contexts})


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """``model`` (a transformers model) runs attention implementation ``name`` inside the block."""
    previous = model.config._attn_implementation
    if previous == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def shard_policy(
    packed: torch.nn.Module, mesh_device: torch.device, world_size: int, *, bfloat16: bool
) -> torch.nn.Module:
    """Shard ``packed`` (a :class:`trainer.forward.packed.PackedLogprobs` over a policy without
    peft) with FSDP2 in place and return it: ``fully_shard`` per decoder layer, then ``packed`` as the
    root, gradients summed, ``bfloat16``: ``MixedPrecisionPolicy(bfloat16, reduce float32)``. A
    collective over ``world_size`` ranks on ``mesh_device``, with identical weights. Raises
    ValueError for a peft (LoRA) model or a decoder without ``layers``."""
    model = packed.model
    if base_model(model) is not model:
        raise ValueError(
            "trainer.parallel fsdp does not support trainer.lora.enabled: LoRA trains a small adapter whose AdamW "
            "state is tiny, so DDP (trainer.parallel: ddp) costs little more memory; use ddp with LoRA"
        )
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layers (get_decoder().layers) to shard")
    mesh = init_device_mesh(mesh_device.type, (world_size,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bfloat16
        else MixedPrecisionPolicy()
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(packed, mesh=mesh, mp_policy=policy)
    for module in packed.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM); divides by 1: none
    return packed


def shard_keeping_optimizer_state(
    packed: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    build: Callable[[], torch.optim.Optimizer],
    mesh_device: torch.device,
    world_size: int,
    *,
    bfloat16: bool,
) -> torch.optim.Optimizer:
    """:func:`shard_policy`, then ``build()``'s optimizer over the sharded parameters, carrying
    ``optimizer``'s state (a loaded one-rank checkpoint's AdamW moments); returns it (drop the old)."""
    model = packed.model
    full = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=full) if optimizer.state else None
    shard_policy(packed, mesh_device, world_size, bfloat16=bfloat16)
    sharded = build()
    if state is not None:
        set_optimizer_state_dict(model, sharded, state, options=full)
    return sharded


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of ``params`` to total L2 norm ``max_norm``; returns the norm before
    clipping (NaN/inf returned, not raised). DTensor gradients: the norm is reduced over the mesh,
    so every rank scales alike (torchtitan's ``clip_grad_norm_``)."""
    if not any(isinstance(p, DTensor) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


# -- weights to the producers, one tensor at a time --------------------------------------------------


def weight_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of ``model.state_dict()`` in order, tied aliases dropped (the first
    name stays, as in ``build_manifest``): the same list on every rank."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


@torch.no_grad()
def full_entry(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``full_tensor()`` of a DTensor (an all-gather: every rank must call it
    for the same entry at the same time), a plain tensor (a buffer) as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


class GatheredWeights(Mapping):
    """The sharded ``model``'s weights for the producers, each gathered when read: ``self[name]``
    calls ``announce(k)`` (``DataParallel.send_gather``) and returns a new full tensor, floating
    ones cast to ``dtype`` (None: float32); ``items()`` and ``values()`` give shape and dtype
    stand-ins without gathering (all ``build_manifest`` reads)."""

    def __init__(
        self, model: torch.nn.Module, announce: Callable[[int], None], dtype: torch.dtype | None = None
    ) -> None:
        self._entries = weight_entries(model)
        self._index = {name: k for k, (name, _) in enumerate(self._entries)}
        self._announce = announce
        self._dtype = dtype
        self._stand_ins = {
            name: torch.empty(1, dtype=self._cast_dtype(t.dtype)).expand(tuple(t.shape)) for name, t in self._entries
        }

    def _cast_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self._dtype if self._dtype is not None and dtype.is_floating_point else dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        k = self._index[name]
        self._announce(k)
        full = full_entry(self._entries[k][1])
        return full.to(self._cast_dtype(full.dtype))

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def items(self):
        return list(self._stand_ins.items())

    def values(self):
        return list(self._stand_ins.values())


# -- sharded checkpoints (torch.distributed.checkpoint) ------------------------------------------------


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write this rank's model and optimizer shards into ``directory`` (DCP: one ``.distcp`` per
    rank, rank 0's ``.metadata``). A collective, on a filesystem every rank sees."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load :func:`save_sharded`'s ``directory`` into the sharded ``model`` and ``optimizer`` in
    place (any world size; a collective). Raises ValueError if it holds no DCP checkpoint."""
    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory}: no torch.distributed.checkpoint files (.metadata missing)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_sharded_policy(directory: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The policy of :func:`save_sharded`'s ``directory`` (``.metadata`` + ``*.distcp``) as one plain
    transformers model in eval mode on CPU, read on ONE process with no process group (``busctl
    export``): built from ``config`` in the shards' dtype (init skipped, tied weights re-tied), filled
    by ``dcp.load(no_dist=True)``. Raises ValueError for no DCP files, several weight dtypes, or a
    weight missing or of another shape."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory}: no torch.distributed.checkpoint files (.metadata missing)")
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    dtypes = {
        m.properties.dtype
        for k, m in saved.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata) and m.properties.dtype.is_floating_point
    }
    if len(dtypes) > 1:
        raise ValueError(
            f"{directory}: weights of several dtypes {sorted(map(str, dtypes))}; expected one (the master weights)"
        )
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtypes.pop() if dtypes else torch.float32)
    model.tie_weights()
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in a single process: what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    except CheckpointException as err:  # a BaseException, holding each rank's error (one rank here)
        why = "; ".join(str(exc) for exc, _trace in err.failures.values())
        raise ValueError(f"{directory}: the shards do not fit a {type(model).__name__} of this config: {why}") from err
    model.load_state_dict(state["model"])  # DCP loads into these tensors in place; this checks every name and shape
    return model.eval()
