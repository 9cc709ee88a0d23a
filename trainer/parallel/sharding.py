"""FSDP2 sharding of the trainer (``trainer.parallel: fsdp``), activation checkpointing, gradient
clipping over sharded gradients, sharded checkpoints, and gathering the weights one tensor at a
time for the producers.

Sharding (:func:`shard_policy`): torch's FSDP2 ``fully_shard`` on each decoder layer, then on the
packed forward (:class:`trainer.forward.packed.PackedLogprobs`, the module the trainer calls: its
forward reads the LM head's weight directly, so the root must be this module, whose pre-forward
hook unshards the embeddings, final norm and LM head). Every parameter becomes a ``DTensor``
sharded on dim 0 over the data-parallel ranks (one 1-D device mesh over the default group); each
rank holds 1/W of the weights, of the gradients after the reduce-scatter and of AdamW's moments.

Sharded checkpoints (:func:`save_sharded`, :func:`load_sharded`): torch.distributed.checkpoint
(DCP) files of ``{"model": ..., "optimizer": ...}`` under a checkpoint's ``sharded/``, written and
read by every rank; :func:`read_sharded_policy` reads the model part on one process with no
process group into a plain transformers model (``busctl export``).

Invariants:
- gradients are SUMMED over ranks (``set_gradient_divide_factor(1.0)`` with
  ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: a plain SUM reduce-scatter, as
  :func:`trainer.parallel.distributed.sum_gradients_hook` does for DDP: each micro-batch loss is already
  divided by step-wide totals, so the sum over ranks is the one-rank gradient);
- gradients are reduce-scattered after EVERY micro-batch's backward and accumulate in the
  float32 sharded gradients (FSDP2's default; torchtitan does the same). Deferring the sync to
  the step's last micro-batch (``set_requires_gradient_sync(False)`` before) saves
  communication but keeps an unsharded float32 gradient of the whole model on every rank
  between micro-batches: measured +3 to +5 bytes/param at 2 ranks on a 100M model
  (bench/README.md), more than the sharded weights, grads and AdamW state of 8 ranks together;
  sharding exists to save memory, so the sync is per micro-batch. Every rank runs the same
  number of micro-batch slots (padding), so every rank joins every reduce-scatter;
- ``trainer.dtype: bfloat16``: ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`` (torchtitan's default policy): the all-gathered weights compute in
  bfloat16, gradients are reduced in float32, the sharded master weights and AdamW's state stay
  float32;
- every collective here (the all-gathers of forward/backward, :class:`GatheredWeights`'s
  ``full_tensor``, DCP save/load) runs on every rank in the same order: the leader announces
  the out-of-step ones through :mod:`trainer.parallel.distributed` (GATHER, SAVE, TEXT messages).

Not supported with fsdp (refused at start with a ValueError): LoRA (the adapter is a few MB, its
AdamW state too: DDP's full replica of the frozen base costs what FSDP would save only on the
base weights, and peft's merge and adapter payloads would need DTensor-aware code), and the QeRL
noise scheduler (its noisy copies are drawn from whole RMSNorm weights while the payload is
gathered one tensor at a time; not done).
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
    """Recompute each decoder layer's activations in the backward (``trainer.activation_checkpointing``).

    Uses transformers' per-layer checkpointing (``GradientCheckpointingLayer``: each decoder
    layer's call goes through ``torch.utils.checkpoint.checkpoint`` in train mode) in its
    non-reentrant form (``use_reentrant=False``: works with FSDP2 and with frozen inputs, no
    ``enable_input_require_grads`` needed). The recomputation runs under the attention
    implementation of the forward (``context_fn``): the packed forward switches to its varlen
    attention for the forward only (:func:`trainer.forward.packed_attention.packed_attention`). Gradients are unchanged up to float rounding of the
    recomputation (bit-identical on CPU: the same kernels run again).

    Raises:
        ValueError: the model does not support gradient checkpointing.
    """
    hf = base_model(model)
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(hf).__name__} does not support activation checkpointing; set trainer.activation_checkpointing: false"
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
    """Shard ``packed`` (a :class:`trainer.forward.packed.PackedLogprobs`) with FSDP2 in place; returns it.

    ``fully_shard`` on each decoder layer (``model.get_decoder().layers``), then on ``packed`` as
    the root; gradient divide factor 1 (summed gradients, see the module docstring). A collective
    only through the mesh's creation; call on every rank with the same (identical) weights: each
    rank keeps its own dim-0 chunk of every parameter.

    Args:
        packed: the packed forward; ``packed.model`` is the policy (not peft-wrapped).
        mesh_device: the ranks' device (``DataParallel.device``): CPU with gloo, ``cuda:r`` with nccl.
        world_size: data-parallel ranks (the mesh size, the default group's).
        bfloat16: compute in bfloat16 (``trainer.dtype``), see the module docstring.

    Raises:
        ValueError: a peft (LoRA) model, or a decoder without ``layers``.
    """
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
    """:func:`shard_policy`, then a new optimizer (``build()``, over the sharded parameters) that
    carries ``optimizer``'s state, sharded: a trainer that loaded a one-rank (full) checkpoint
    continues with its AdamW moments. Returns the new optimizer (the old one holds the replaced
    unsharded parameters: drop it)."""
    model = packed.model
    full = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=full) if optimizer.state else None
    shard_policy(packed, mesh_device, world_size, bfloat16=bfloat16)
    sharded = build()
    if state is not None:
        set_optimizer_state_dict(model, sharded, state, options=full)
    return sharded


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of ``params`` to total L2 norm ``max_norm``; returns the norm before clipping.

    Plain tensors: ``torch.nn.utils.clip_grad_norm_`` (unchanged). DTensor (FSDP-sharded)
    gradients: the norm of the local shards is reduced over the mesh (``full_tensor``) so every
    rank scales by the same factor ``min(1, max_norm / (norm + 1e-6))`` (torch's formula), as
    torchtitan's ``clip_grad_norm_`` does. NaN/inf norms are returned, not raised.
    """
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
    """``(hf_name, tensor)`` of ``model.state_dict()`` in its order, tied aliases dropped (the
    first name of a shared tensor stays, as ``broadcaster.manifest.build_manifest`` keeps it).
    The same list on every rank: index ``k`` names one tensor everywhere."""
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
    """The policy's weights for the producers, each gathered only when it is read.

    ``self[name]`` calls ``announce(k)`` (the leader tells the followers to gather entry ``k`` of
    :func:`weight_entries` too) and returns that entry's :func:`full_entry`, a new full tensor
    the caller drops after copying it: the broadcast sender copies a bucket at a time, so rank 0
    holds one bucket of full tensors beyond its send buffers (the filesystem sender keeps the
    whole model in CPU memory while writing its one file).

    ``items()`` and ``values()`` do NOT gather: they yield stand-ins with the right shape and
    dtype (one element of storage each, distinct per tensor; ``expand``-ed), enough for
    ``broadcaster.manifest.build_manifest``, which reads only shape, dtype and ``data_ptr``.
    Iterating keys gives the names without aliases (``len`` counts them).

    Args:
        model: the sharded policy (its ``state_dict()`` holds DTensors).
        announce: called with the entry index before each gather (``DataParallel.send_gather``).
        dtype: the dtype the producers load (floating entries are cast to it after the gather,
            e.g. bfloat16: half the bytes); None: as trained (float32).
    """

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
    """Write this rank's shards of the model and optimizer state into ``directory`` (DCP format:
    one ``.distcp`` file per rank plus rank 0's ``.metadata``). A collective: every rank calls
    it with the same ``directory`` (on a filesystem all of them see)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load :func:`save_sharded`'s ``directory`` into the sharded ``model`` and ``optimizer`` in
    place (DCP reads each rank's part; the world size may differ from the saving run's). A
    collective, as :func:`save_sharded`.

    Raises:
        ValueError: ``directory`` holds no DCP checkpoint.
    """
    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory}: no torch.distributed.checkpoint files (.metadata missing)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_sharded_policy(directory: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The policy weights of :func:`save_sharded`'s ``directory`` as one plain (unsharded)
    transformers model, read on ONE process with no process group (``busctl export``).

    The model is built from ``config`` (``AutoModelForCausalLM.from_config``, weight init skipped:
    every weight is read) in the dtype the shards were saved in (the float32 master weights of
    the trainer), its tied weights tied again (``tie_weights``: init skipping leaves them apart),
    then ``dcp.load(..., no_dist=True)`` fills each tensor of its ``state_dict()`` from the
    checkpoint's ``model`` entries, reassembling the dim-0 shards of every saving rank (any world
    size). The optimizer's entries are not read.

    Args:
        directory: a checkpoint's ``sharded/`` directory (``.metadata`` + ``*.distcp``).
        config: the policy's transformers config (the checkpoint's ``config.json``).

    Returns:
        The model (eval mode, on CPU).

    Raises:
        ValueError: no DCP files, or a weight of the model is missing from them or has another
            shape (``config`` is not the config of the run that saved them).
    """
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
