"""Run-directory safety: ``busctl up`` never deletes a run it did not make.

A fresh ``busctl up`` needs its ``run_dir`` missing or empty; an occupied one is refused (exit 2) with what it
holds and the ways on: ``--resume``, another ``run_dir=``, or ``--overwrite``, which deletes only a directory
that looks like a run's (a :data:`RUN_MARKERS` file, or nothing but run outputs), announcing each entry first.
Any other non-empty directory (``run_dir=.`` by mistake) is refused even then. ``busctl eval`` replaces only a
previous eval (:func:`holds_eval_run`). The rules for users: docs/operations.md, "Stopping and resuming".
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from busctl.run_status import RUN_OUTPUTS

RUN_MARKERS = ("config.yaml", "status.json")
"""Files that make a directory a run's: every ``busctl up`` writes ``config.yaml`` while preparing."""


@dataclass(frozen=True)
class Occupant:
    """What a non-empty ``run_dir`` holds.

    Attributes:
        entries: its entries' names, sorted (directories with a trailing ``/``).
        is_run: it holds a :data:`RUN_MARKERS` file or nothing but run outputs (``--overwrite`` may delete it).
        details: human lines about the previous run (outcome and step, checkpoints, metrics lines).
    """

    run_dir: Path
    entries: tuple[str, ...]
    is_run: bool
    details: tuple[str, ...]

    def what(self) -> str:
        """One paragraph: the entries and the details, for refusals and the overwrite notice."""
        shown = ", ".join(self.entries[:12]) + (
            f", ... ({len(self.entries)} entries)" if len(self.entries) > 12 else ""
        )
        return "; ".join([shown, *self.details])


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _details(run_dir: Path) -> list[str]:
    """What a reader wants to know before deleting ``run_dir``: its last state, step and checkpoints."""
    out = []
    try:
        status = json.loads((run_dir / "status.json").read_text())
        step, total = status.get("step"), status.get("max_steps")
        out.append(
            f"last run: {status.get('outcome') or status.get('state') or '?'}"
            + (f" at step {step}/{total}" if step is not None else "")
        )
    except (OSError, ValueError, AttributeError):
        pass
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        names = sorted(p.name for p in checkpoints.iterdir())
        if names:
            out.append(f"checkpoints/: {len(names)} ({', '.join(names[-3:])}{', ...' if len(names) > 3 else ''})")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        out.append(f"metrics.jsonl: {_count_lines(metrics)} lines")
    return out


def inspect_run_dir(run_dir: Path) -> Occupant | None:
    """What ``run_dir`` holds, or None when it is missing or empty (a fresh run may start there).

    Raises:
        ValueError: ``run_dir`` exists and is not a directory, or cannot be listed.
    """
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise ValueError(f"run_dir {run_dir} is a file, not a directory: give another run_dir=")
    try:
        children = sorted(run_dir.iterdir())
    except OSError as err:
        raise ValueError(f"run_dir {run_dir} cannot be listed ({err.strerror}): give another run_dir=") from None
    if not children:
        return None
    names = {p.name for p in children}
    is_run = any(m in names for m in RUN_MARKERS) or names <= set(RUN_OUTPUTS)
    entries = tuple(p.name + ("/" if p.is_dir() else "") for p in children)
    return Occupant(run_dir, entries, is_run, tuple(_details(run_dir)))


def holds_eval_run(occupant: Occupant) -> bool:
    """Whether the occupied directory is a previous ``busctl eval``'s (``eval.only: true`` in its
    ``config.yaml``)."""
    try:
        saved = yaml.safe_load((occupant.run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("eval"), dict) and saved["eval"].get("only") is True


def refusal(occupant: Occupant, command: str, elsewhere: str) -> str:
    """The message of ``busctl up`` refusing an occupied ``run_dir`` (exit 2); ``command``: the command line as given
    (shown with ``--overwrite``), ``elsewhere``: the same with another ``run_dir=``."""
    d = occupant.run_dir
    if not occupant.is_run:
        return (
            f"run_dir {d} is not empty and holds no rlbus run (no config.yaml or status.json): {occupant.what()}.\n"
            f"busctl up deletes nothing there, not even with --overwrite: give another run_dir=, e.g.\n"
            f"  {elsewhere}\nor empty that directory yourself"
        )
    return (
        f"run_dir {d} holds another run's outputs: {occupant.what()}.\n"
        f"busctl up does not delete a run it did not make; go on with one of:\n"
        f"  continue that run:           busctl up --resume {d}\n"
        f"  start this one elsewhere:    {elsewhere}\n"
        f"  delete that run, start over: {command} --overwrite"
    )


def overwrite(occupant: Occupant, say, why: str = "--overwrite") -> None:
    """Delete every entry of an occupied run directory, each announced with ``say`` first (``why`` leads the line).

    Raises:
        ValueError: ``occupant`` is not a run's directory (:func:`refusal` names why).
    """
    if not occupant.is_run:
        raise ValueError(refusal(occupant, "busctl up ...", "busctl up ... run_dir=OTHER"))
    say(f"{why}: deleting the previous run in {occupant.run_dir}: {occupant.what()}")
    for name in occupant.entries:
        target = occupant.run_dir / name.rstrip("/")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
