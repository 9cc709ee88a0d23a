"""The filesystem method: one safetensors directory per version, written by `FilesystemSender` (trainer) and
loaded by `FilesystemReceiver` (producer; its vLLM workers read it). Also the broadcast method's default fallback.

    out_dir/v{version}/model.safetensors   # merged HF weights, or a LoRA adapter payload re-published
                                           # from a failed broadcast's send buffers
    out_dir/v{version}/READY               # written last: the directory is complete

Readers open only a directory with READY; `publish` announces after the write. Every file goes to a temporary
name and is `os.replace`d, so a crash never leaves a half-written file under its final name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from broadcaster.base import WeightReceiver, WeightSender
from broadcaster.manifest import parse_dtype

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
    """Write `manifest`'s tensors (in its dtypes) as `out_dir/v{version}/model.safetensors`, then READY.
    Returns (directory, payload bytes); overwrites an incomplete directory. ValueError: the version is complete."""
    from safetensors.torch import save_file

    directory = version_dir(out_dir, version)
    if is_ready(directory):
        raise ValueError(f"version {version} already written at {directory}; versions must increase")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: state_dict[name].detach().to("cpu", parse_dtype(dtype)).contiguous() for name, dtype, _ in manifest
    }
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
        (int(p.name[1:]), p) for p in Path(out_dir).glob("v*") if p.is_dir() and p.name[1:].isdigit() and is_ready(p)
    )
    removed = [p for _, p in versions[:-keep]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


class FilesystemSender(WeightSender):
    """Writes each version synchronously, keeping the newest `keep_versions` (ValueError if < 1).
    Merged weights, except a failed broadcast re-published from its send buffers (maybe an adapter)."""

    method: ClassVar[str] = "filesystem"
    carries_adapter: ClassVar[bool] = False

    def __init__(self, out_dir: str | Path, *, keep_versions: int | None = 2) -> None:
        if keep_versions is not None and keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1 or None, got {keep_versions}")
        self.out_dir = Path(out_dir)
        self.keep_versions = keep_versions

    def __str__(self) -> str:
        return f"the filesystem method at {self.out_dir}"

    def start_send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, manifest: list[list] | None = None
    ) -> dict:
        """Write `state_dict` as `version` synchronously; the announcement with `path`, plus `blocked_s`.
        Raises ValueError: a bad payload, or `version` already written."""
        start = time.perf_counter()
        manifest = self.manifest(state_dict) if manifest is None else manifest
        directory, num_bytes = write_version(self.out_dir, version, state_dict, manifest)
        if self.keep_versions is not None:
            prune_versions(self.out_dir, self.keep_versions)
        return {
            "method": self.method,
            "version": version,
            "manifest": manifest,
            "path": str(directory),
            "num_bytes": num_bytes,
            "bucket_bytes": None,
            "blocked_s": time.perf_counter() - start,
        }


class FilesystemReceiver(WeightReceiver):
    """Producer side: loads the announced directory; any version applies (a resumed trainer rolls back)."""

    method: ClassVar[str] = "filesystem"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def apply(self, msg: Any) -> None:
        """Load `msg.path` as policy `msg.version`."""
        await self.engine.load_weights_from_path(msg.version, msg.path)
