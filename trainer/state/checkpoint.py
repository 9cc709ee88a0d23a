"""Trainer checkpoints: everything needed to resume training bit-identically after a kill.

``DIR/step_{N:06d}/`` (``N``: optimizer steps done, the saved weights' version) holds the weights
(``save_pretrained``; LoRA: the adapter only) with the tokenizer (:mod:`trainer.state.hf_files`),
``optimizer.pt``, ``scheduler.pt``, ``rng.json``, ``meta.json`` (step, kind, the caller's ``extra``)
and ``DONE``, written last; with fsdp ``sharded/`` replaces the weights and ``optimizer.pt``. A save
goes to a hidden temp directory renamed into place once fsynced, so a kill leaves all or nothing;
the last ``keep`` stay. The ``.pt`` files are our own, still loaded with ``weights_only=True``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

from runfiles.durable import fsync_dir
from trainer.state.hf_files import write_model_files

__all__ = [
    "CheckpointState",
    "has_scheduler_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "snapshot_state",
]

FORMAT = 1
DONE = "DONE"
_NAME = re.compile(r"^step_(\d{6,})$")
_TMP_PREFIX = ".tmp_step_"


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint saves, copied at one moment by :func:`snapshot_state`: ``model_state``
    (trainable tensors cloned, tied ones still tied, frozen ones by reference), deep copies of the
    optimizer and LR scheduler ``state_dict()`` (None without one), and the ``rng`` states."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any] | None
    rng: dict[str, Any]


def _current_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> CheckpointState:
    """The state as it is now, by reference (no copies): what a save on the training thread writes."""
    return CheckpointState(
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        scheduler_state=scheduler.state_dict() if scheduler is not None else None,
        rng=_rng_state(),
    )


def snapshot_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> CheckpointState:
    """Copy what the next optimizer steps would change (trainable weights, optimizer and scheduler
    state, RNG), so :func:`save_checkpoint` can write it later on another thread; frozen weights are
    kept by reference."""
    now = _current_state(model, optimizer, scheduler)
    trainable = {p.data_ptr() for p in model.parameters() if p.requires_grad}
    clones: dict[int, torch.Tensor] = {}
    model_state = {}
    for name, tensor in now.model_state.items():
        ptr = tensor.data_ptr()
        if ptr in trainable:
            if ptr not in clones:
                clones[ptr] = tensor.detach().clone()
            tensor = clones[ptr]
        model_state[name] = tensor
    return CheckpointState(
        model_state=model_state,
        optimizer_state=copy.deepcopy(now.optimizer_state),
        scheduler_state=copy.deepcopy(now.scheduler_state),
        rng=now.rng,
    )


def _kind(model: torch.nn.Module) -> str:
    return "lora" if isinstance(model, PeftModel) else "full"


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories themselves."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def _rng_state() -> dict[str, Any]:
    """All RNG states as JSON-able values (byte tensors become lists of ints)."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple) and np_state[0] == "MT19937"
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_state), py_gauss],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(
                f"the checkpoint has RNG states of {len(state['cuda'])} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; resume with the same CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _checkpoint_step(path: Path) -> int | None:
    """Step of a complete checkpoint directory, else None."""
    m = _NAME.match(path.name)
    if m is None or not path.is_dir() or not (path / DONE).is_file():
        return None
    return int(m.group(1))


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest first (by step); [] if it does not exist."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := _checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint (with ``DONE``) of the highest step under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 2,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    state: CheckpointState | None = None,
    write_state: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``directory/step_{step:06d}/`` atomically (replacing one of the same step), prune to
    the last ``keep`` (>= 1) and return its path. ``step``: optimizer steps done (the weights'
    version); a peft ``model`` saves its adapter only; ``extra``: JSON-able state for
    :func:`load_checkpoint`; ``state``: a :func:`snapshot_state` to write instead of the state now;
    ``write_state``: writes model and optimizer state into the directory it gets instead of
    ``save_pretrained`` and ``optimizer.pt`` (a sharded save every rank joins). Raises ValueError for
    ``step`` < 0, ``keep`` < 1, an ``extra`` with ``"step"`` or not JSON-able, or both ``state`` and
    ``write_state``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    if "step" in extra:
        raise ValueError("extra must not contain 'step': load_checkpoint returns the step under that key")
    if write_state is not None and state is not None:
        raise ValueError("write_state (a sharded save) takes the state as it is now: pass no snapshot")
    meta = {
        "format": FORMAT,
        "step": step,
        "kind": _kind(model),
        "scheduler": scheduler is not None,
        "sharded": write_state is not None,
        "extra": extra,
    }
    try:
        meta_text = json.dumps(meta, indent=1, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON-able (str keys, finite numbers, lists, dicts): {e}") from e

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{_TMP_PREFIX}{step:06d}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if write_state is not None:
        write_state(tmp)
        write_model_files(tmp, model, with_config=True)  # config, generation config, tokenizer: what model it is
        rng = _rng_state()
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    else:
        if state is None:
            state = _current_state(model, optimizer, scheduler)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state.model_state)
        write_model_files(tmp, model)
        torch.save(state.optimizer_state, tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(state.scheduler_state, tmp / "scheduler.pt")
        rng = state.rng
    (tmp / "rng.json").write_text(json.dumps(rng))
    (tmp / "meta.json").write_text(meta_text)
    _fsync_tree(tmp)
    (tmp / DONE).write_text(f"{step}\n")
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        old = root / f"{_TMP_PREFIX}{step:06d}.old.{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)
    _prune(root, keep, final)
    return final


def _prune(root: Path, keep: int, current: Path) -> None:
    """Delete all but the last ``keep`` complete checkpoints, and leftovers of killed saves."""
    for p in list_checkpoints(root)[:-keep]:
        if p != current:
            shutil.rmtree(p)
    for p in root.iterdir():
        incomplete = _NAME.match(p.name) is not None and _checkpoint_step(p) is None
        if p.is_dir() and (p.name.startswith(_TMP_PREFIX) or incomplete):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    read_state: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Restore weights, optimizer, LR scheduler and RNG states from :func:`save_checkpoint`'s
    ``path`` into a fresh ``model`` of the same kind (LoRA: base + the same adapter config) and an
    ``optimizer`` over its trainable parameters in the same order; ``scheduler`` and ``read_state``
    (a sharded checkpoint's loader) exactly when it has them. Returns ``{"step": N, **extra}``.
    Raises ValueError for an incomplete checkpoint, another format or any mismatch."""
    path = Path(path)
    meta = _read_meta(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this code reads {FORMAT}")
    if meta["kind"] != _kind(model):
        raise ValueError(
            f"{path} holds a {meta['kind']} checkpoint but the model is {_kind(model)}; "
            "set trainer.lora.enabled as in the run that wrote it"
        )
    saved_scheduler = bool(meta.get("scheduler", False))
    if saved_scheduler != (scheduler is not None):
        raise ValueError(
            f"{path} {'has' if saved_scheduler else 'has no'} LR scheduler state but "
            f"{'none' if scheduler is None else 'a scheduler'} was passed; "
            "build the trainer as in the run that wrote it"
        )
    sharded = bool(meta.get("sharded", False))
    if sharded != (read_state is not None):
        raise ValueError(
            f"{path} holds a {'sharded (fsdp)' if sharded else 'one-file (one rank or ddp)'} checkpoint but the "
            f"trainer is {'sharded' if read_state is not None else 'not sharded'}; "
            "set trainer.parallel as in the run that wrote it"
        )
    if read_state is not None:
        read_state(path)
    else:
        if isinstance(model, PeftModel):
            _load_adapter(path, model)
        else:
            _load_full(path, model)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    _set_rng_state(json.loads((path / "rng.json").read_text()))
    return {"step": int(meta["step"]), **meta["extra"]}


def has_scheduler_state(path: str | os.PathLike[str]) -> bool:
    """Whether checkpoint ``path`` holds an LR scheduler's state (older ones have none); ValueError
    if it is not complete."""
    return bool(_read_meta(Path(path)).get("scheduler", False))


def _read_meta(path: Path) -> dict:
    """``meta.json`` of the complete checkpoint ``path`` (ValueError without ``DONE``)."""
    if not (path / DONE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {DONE} marker); use latest_checkpoint()")
    return json.loads((path / "meta.json").read_text())


def _load_full(path: Path, model: torch.nn.Module) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:  # one file, or the shards of a large model
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{path}: weights the model does not have: {result.unexpected_keys[:5]}")
    # save_pretrained leaves out tied weights (e.g. lm_head = embed_tokens); those are loaded
    # through the tensor they share storage with. Anything else missing is an error.
    params = model.state_dict()
    loaded_ptrs = {params[k].data_ptr() for k in state}
    missing = [k for k in result.missing_keys if params[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {missing[:5]}")


def _load_adapter(path: Path, model: PeftModel) -> None:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors")
    adapter = load_file(file)
    result = set_peft_model_state_dict(model, adapter)
    if result.unexpected_keys:
        raise ValueError(f"{path}: adapter weights the model does not have: {result.unexpected_keys[:5]}")
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise ValueError(f"{path}: adapter weights missing from the checkpoint: {missing[:5]}")
