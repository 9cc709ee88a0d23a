"""Where the trainer's checkpoints are in a run directory, read by the components that resume from
them (the packer numbers steps from the latest, the prompt source forgets eval rounds above it).

Layout (written by :mod:`trainer.state.checkpoint`): ``RUN_DIR/checkpoints/step_N/``, complete once it
holds a ``DONE`` file. Only files are read here: no trainer code, no sockets.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
"""The trainer's checkpoint root under the run directory (``step_NNNNNN/`` with a ``DONE`` file)."""


def checkpoint_step(run_dir: str | os.PathLike[str]) -> int:
    """The step of the trainer's latest complete checkpoint in ``run_dir`` (``checkpoints/step_N``
    holding a ``DONE`` file), or 0 if there is none: the step a resumed run continues from."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    steps = [0]
    if root.is_dir():
        for p in root.iterdir():
            name = p.name
            if name.startswith("step_") and name[5:].isdigit() and (p / "DONE").is_file():
                steps.append(int(name[5:]))
    return max(steps)
