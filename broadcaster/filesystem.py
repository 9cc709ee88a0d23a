"""The filesystem method: one safetensors directory per policy version, written by
`FilesystemSender` (trainer) and loaded by `FilesystemReceiver` (producer process; its vLLM workers
read it, `broadcaster.worker_extension`). It is also what the broadcast method falls back to.

Layout written by `write_version(out_dir, version, state_dict)`:

    out_dir/v{version}/model.safetensors   # the payload's tensors: merged HF weights (aliases such
                                           # as a tied lm_head dropped), or a LoRA adapter payload
                                           # (`broadcaster.manifest`) when the trainer re-publishes a
                                           # failed background broadcast from its send buffers
    out_dir/v{version}/READY               # written last, atomically: the directory is complete

Readers (`broadcaster.worker_extension.WeightSyncExtension.load_weights_from_path`) must only open a
directory whose READY marker exists (`is_ready`); `FilesystemSender.publish` announces a version only
after `write_version` returned, so a producer acting on the announcement always finds it complete.
Every file is written to a temporary name and `os.replace`d, so a crash never leaves a
half-written file under its final name.
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
    """Write the tensors named in `manifest` as `out_dir/v{version}/model.safetensors`, then READY.

    Each tensor is written in its manifest entry's dtype (cast on the way when the manifest says
    a narrower wire dtype, `broadcaster.manifest`). Returns (directory, payload bytes).
    Overwrites an incomplete directory of the same version.
    """
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
    """Writes each version synchronously as `out_dir/v{version}/` (`write_version`), then it may be
    announced; keeps the newest `keep_versions` complete directories.

    The trainer sends merged weights this way (`carries_adapter` False: `broadcast.lora_payload`
    applies to the broadcast method only), except when it re-publishes a failed broadcast from its
    send buffers, whose payload may be an adapter (producers load both kinds).

    Raises:
        ValueError: `keep_versions < 1`.
    """

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
        """Write `state_dict` as `version` (synchronously, despite the name; nothing stays in flight).

        Returns `{"method", "version", "manifest", "path", "num_bytes", "bucket_bytes": None,
        "blocked_s"}` with `path` the version directory.

        Raises:
            ValueError: a bad payload (`build_manifest`), or `version` already written.
        """
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
    """Producer side of the filesystem method: loads the announced version directory into the
    engine (`RolloutEngine.load_weights_from_path`). Any version is applicable, an older one too
    (a trainer resumed from its checkpoint rolls the policy back)."""

    method: ClassVar[str] = "filesystem"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def apply(self, msg: Any) -> None:
        """Load `msg.path` as policy `msg.version`."""
        await self.engine.load_weights_from_path(msg.version, msg.path)
