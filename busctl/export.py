"""``busctl export RUN_DIR [--step N] --out DIR [--merge-lora]``: a run's checkpoint as a plain Hugging Face
model directory, without the training state (``*.pt``, ``rng.json``, ``meta.json``, ``DONE``, subdirectories).

Full fine-tuning gives the weights, configs, tokenizer and chat template (a sharded fsdp checkpoint is read on
this one process, no process group, and written with ``save_pretrained``); LoRA gives the PEFT adapter, or with
``--merge-lora`` the merged model (peft's ``merge_and_unload``: ``W + (alpha / r) B A``, Hu et al. 2021 eq. 3,
float32). A checkpoint without a tokenizer or model config gets the run's ``model.path``'s. Written into a
hidden directory beside ``DIR`` and renamed when complete; a non-empty ``DIR`` is refused. Usage:
docs/operations.md, "Checkpoints".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from busctl.stderr import print_error

__all__ = ["ExportError", "add_command", "export_checkpoint", "find_checkpoint"]

TRAINING_STATE = frozenset({"rng.json", "meta.json", "DONE"})
"""Checkpoint files that are resume state, not model files (besides ``*.pt``)."""


class ExportError(ValueError):
    """The run, checkpoint or output directory of an export is not usable (the message says why)."""


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (None: the latest).

    Raises:
        ExportError: no checkpoints directory, no complete checkpoint, or none at ``step`` (lists the steps).
    """
    from trainer.state.checkpoint import list_checkpoints

    root = run_dir / "checkpoints"
    found = list_checkpoints(root)
    if not found:
        raise ExportError(
            f"no complete checkpoint in {root} (a run writes one every trainer.checkpoint_interval steps)"
        )
    if step is None:
        return found[-1]
    for path in found:
        if int(path.name.removeprefix("step_")) == step:
            return path
    raise ExportError(
        f"no complete checkpoint of step {step} in {root}; there are steps "
        f"{[int(p.name.removeprefix('step_')) for p in found]}"
    )


def _run_model_path(run_dir: Path) -> str:
    """The ``model.path`` of the run (its ``config.yaml``), "" when unknown."""
    from configs.schema import load_config

    saved = run_dir / "config.yaml"
    return load_config(saved).model.path if saved.is_file() else ""


def _copy_model_files(checkpoint: Path, out: Path) -> None:
    for item in sorted(checkpoint.iterdir()):
        if item.is_file() and item.name not in TRAINING_STATE and item.suffix != ".pt":
            shutil.copy2(item, out / item.name)


def _merge_lora(checkpoint: Path, base_path: str, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)


def _write_sharded(checkpoint: Path, out: Path, base_path: str) -> None:
    """Write the sharded ``checkpoint`` into ``out`` as ``save_pretrained`` files, read on this process; the model
    config is the checkpoint's ``config.json``, else ``base_path``'s. ExportError: no config, or shards that do not
    fit it."""
    from transformers import AutoConfig, GenerationConfig

    from configs.model_path import resolve_model_path
    from trainer.parallel.sharding import SHARDED_DIR, read_sharded_policy

    if (checkpoint / "config.json").is_file():
        source = str(checkpoint)
    elif base_path:
        source = resolve_model_path(base_path)
    else:
        raise ExportError(
            f"{checkpoint}: a sharded checkpoint without config.json and the run's model.path is unknown "
            "(no RUN_DIR/config.yaml): cannot tell which model its shards are"
        )
    try:
        model = read_sharded_policy(checkpoint / SHARDED_DIR, AutoConfig.from_pretrained(source))
    except ValueError as err:
        raise ExportError(str(err)) from err
    if (Path(source) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    model.save_pretrained(out, safe_serialization=True)


def _add_tokenizer(out: Path, source: str) -> None:
    """Save ``source``'s tokenizer into ``out`` unless ``out`` already holds one."""
    from transformers import AutoTokenizer

    if (out / "tokenizer_config.json").is_file():
        return
    if not source:
        raise ExportError(f"{out}: the checkpoint holds no tokenizer and the run's model.path is unknown")
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def _public_modes(directory: Path) -> None:
    """Give every file in ``directory`` the umask's default mode (0644 under umask 022): ``save_pretrained``
    writes its weights through a private temp file (0600), and copies keep the checkpoint's modes."""
    umask = os.umask(0)
    os.umask(umask)
    for item in directory.rglob("*"):
        if item.is_file():
            item.chmod(0o666 & ~umask)


def export_checkpoint(checkpoint: Path, out: Path, *, merge_lora: bool = False, base_path: str = "") -> Path:
    """Write ``checkpoint`` (a complete ``step_N`` directory) as a model directory ``out`` (empty or missing);
    returns ``out`` resolved. ``merge_lora``: write a LoRA checkpoint's merged model, not the adapter;
    ``base_path``: the run's ``model.path``, the base of a merge when ``adapter_config.json`` names none that
    exists, and the tokenizer of a checkpoint without one.

    Raises:
        ExportError: ``checkpoint`` is not complete, is sharded with an unknown model config or shards that do not
            fit it, or ``out`` holds files.
    """
    from configs.model_path import resolve_model_path

    if not (checkpoint / "DONE").is_file():
        raise ExportError(f"{checkpoint} is not a complete checkpoint (no DONE marker)")
    meta = json.loads((checkpoint / "meta.json").read_text())
    out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory; pick a new one")
    lora = meta.get("kind") == "lora"
    sharded = bool(meta.get("sharded"))
    if sharded and lora:
        raise ExportError(
            f"{checkpoint}: a sharded LoRA checkpoint, which no trainer writes (trainer.parallel fsdp "
            "refuses LoRA); it cannot be exported"
        )
    base = base_path
    if lora:
        named = json.loads((checkpoint / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        base = named if named and Path(named).is_dir() else base_path
        if not base:
            raise ExportError(
                f"{checkpoint}: a LoRA adapter whose base model is unknown (no base_model_name_or_path, "
                "no run config.yaml)"
            )
        base = resolve_model_path(base)
    tmp = out.parent / f".tmp_export_{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer_source = resolve_model_path(base) if base else ""
        if lora and merge_lora:
            _merge_lora(checkpoint, base, tmp)  # config.json, generation_config.json, the weights
            if (checkpoint / "tokenizer_config.json").is_file():
                tokenizer_source = str(checkpoint)  # the checkpoint's own tokenizer and chat template
        else:
            _copy_model_files(checkpoint, tmp)  # its tokenizer files among them
            if sharded:
                _write_sharded(checkpoint, tmp, base_path)
        _add_tokenizer(tmp, tokenizer_source)
        _public_modes(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cmd_export(ns: argparse.Namespace, console: Console) -> int:
    """``busctl export``: 0 written, 1 a run or checkpoint that cannot be exported, 2 bad usage."""
    run_dir = Path(ns.run_dir)
    if not run_dir.is_dir():
        print_error(f"busctl export: no run directory {run_dir}")
        return 2
    try:
        checkpoint = find_checkpoint(run_dir, ns.step)
        out = export_checkpoint(checkpoint, Path(ns.out), merge_lora=ns.merge_lora, base_path=_run_model_path(run_dir))
    except ExportError as err:
        print_error(f"busctl export: {err}")
        return 1
    kind = json.loads((checkpoint / "meta.json").read_text()).get("kind")
    what = (
        "merged model"
        if kind == "lora" and ns.merge_lora
        else ("LoRA adapter (PEFT format)" if kind == "lora" else "model")
    )
    console.print(f"exported {checkpoint.name} of {run_dir} as a {what} to {out}")
    if kind == "lora" and not ns.merge_lora:
        console.print("load it with PeftModel.from_pretrained(base, DIR); serve it with vLLM after --merge-lora")
    else:
        console.print(f"use it as model.path={out}, or evaluate it: busctl eval CONFIG model.path={out}")
    return 0


def add_command(sub: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace, Console], int]]:
    """Register ``export`` on the ``busctl`` subparsers ``sub``; returns ``{"export": handler}``."""
    ex = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model directory (no training state)",
        description="Write a checkpoint of RUN_DIR as a model directory that AutoModelForCausalLM, "
        "AutoTokenizer, vLLM and a new run's model.path load as it is (a LoRA run: its adapter in PEFT's "
        "format, or with --merge-lora the merged model).",
    )
    ex.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds checkpoints/)")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    ex.add_argument("--out", required=True, help="new output directory (must not exist, or be empty)")
    ex.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA run: merge the adapter into the base (peft merge_and_unload) and write the full model",
    )
    return {"export": cmd_export}
