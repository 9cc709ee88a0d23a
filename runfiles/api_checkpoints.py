"""Where ``busctl serve`` keeps a training client's checkpoints: ``tinker://MODEL/weights/NAME`` (state:
HF or peft files + ``optimizer.pt``) and ``tinker://MODEL/sampler_weights/NAME`` (merged safetensors the
sampler loads) are directories under ``RUN_DIR/api/``; the trainer writes them, the API process and the
sampler find them by the same mapping."""

from __future__ import annotations

from pathlib import Path

KINDS = ("weights", "sampler_weights")


def checkpoint_dir(run_dir: Path, tinker_path: str) -> Path:
    """``RUN_DIR/api/<model>/<kind>/<name>`` of ``tinker://<model>/<kind>/<name>`` (``:`` in a model id
    becomes ``-``). ValueError for any other path, or a part that is empty, ``.`` or ``..``."""
    parts = tinker_path.removeprefix("tinker://").split("/")
    if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
        raise ValueError(f"not a checkpoint path of this server: {tinker_path!r} (tinker://MODEL/weights/NAME)")
    if any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ValueError(f"bad checkpoint path {tinker_path!r}")
    return Path(run_dir) / "api" / parts[0].replace(":", "-") / parts[1] / parts[2]
