"""Filesystem weight transport: one safetensors directory per policy version.

Layout written by `write_version(out_dir, version, state_dict)`:

    out_dir/v{version}/model.safetensors   # the payload's tensors: merged HF weights (aliases such
                                           # as a tied lm_head dropped), or a LoRA adapter payload
                                           # (`broadcaster.manifest`) when the trainer re-publishes a
                                           # failed background broadcast from its send buffers
    out_dir/v{version}/READY               # written last, atomically: the directory is complete

Readers (`producers.weight_sync.WeightSyncExtension.load_weights_from_path`) must only open a
directory whose READY marker exists (`is_ready`); the trainer announces a version only after
`write_version` returned, so a producer acting on the announcement always finds it complete.
Every file is written to a temporary name and `os.replace`d, so a crash never leaves a
half-written file under its final name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

READY_MARKER = "READY"
WEIGHTS_FILE = "model.safetensors"


def version_dir(out_dir: Path, version: int) -> Path:
    """Directory of one policy version."""
    return Path(out_dir) / f"v{version}"


def is_ready(path: str | Path) -> bool:
    """Whether a version directory is complete (its READY marker exists)."""
    return (Path(path) / READY_MARKER).is_file()


def write_version(
    out_dir: Path, version: int, state_dict: Mapping[str, torch.Tensor], manifest: list[list]
) -> tuple[Path, int]:
    """Write the tensors named in `manifest` as `out_dir/v{version}/model.safetensors`, then READY.

    Returns (directory, payload bytes). Overwrites an incomplete directory of the same version.
    """
    from safetensors.torch import save_file

    directory = version_dir(out_dir, version)
    if is_ready(directory):
        raise ValueError(f"version {version} already written at {directory}; versions must increase")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: state_dict[name].detach().to("cpu").contiguous() for name, _, _ in manifest}
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "rlbus_version": str(version)})
    os.replace(tmp, directory / WEIGHTS_FILE)
    marker_tmp = directory / f".{READY_MARKER}.tmp"
    marker_tmp.write_text(json.dumps({"version": version, "num_bytes": num_bytes}))
    os.replace(marker_tmp, directory / READY_MARKER)
    return directory, num_bytes


def prune_versions(out_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete version directories; returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = sorted(
        (int(p.name[1:]), p) for p in Path(out_dir).glob("v*")
        if p.is_dir() and p.name[1:].isdigit() and is_ready(p)
    )
    removed = [p for _, p in versions[:-keep]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed
