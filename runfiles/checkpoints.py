"""Where the trainer's checkpoints are (written by :mod:`trainer.state.checkpoint`): ``RUN_DIR/checkpoints/
step_N/``, complete once it holds ``DONE``; read without trainer code by the packer and the prompt source."""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"


def checkpoint_step(run_dir: str | os.PathLike[str]) -> int:
    """The step of the latest complete checkpoint in ``run_dir`` (0: none), where a resumed run continues."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    steps = [0]
    if root.is_dir():
        for p in root.iterdir():
            name = p.name
            if name.startswith("step_") and name[5:].isdigit() and (p / "DONE").is_file():
                steps.append(int(name[5:]))
    return max(steps)
