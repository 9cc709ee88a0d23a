"""What Slurm says about a run's steps, nodes and job: queries that tell "unknown" from "gone".

Every query runs a Slurm client (``squeue``, ``scontrol``, ``scancel``) with a timeout; one that fails is
retried and then raises :class:`SlurmUnavailable` naming the command, exit code and stderr: the answer is
*unknown*, never "the step ended" or "the node is fine". The callers (:mod:`busctl.launchers.slurm`) decide what
unknown means: a signal falls back to the step's ``srun``; a crash check leaves the node alone.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from typing import Callable

log = logging.getLogger(__name__)

SLURM_TIMEOUT_S = 30.0
"""Longest wait for one ``scontrol`` / ``squeue`` / ``scancel`` call, seconds."""

QUERY_TRIES = 3
"""Tries of a failing Slurm client before its answer is unknown (:class:`SlurmUnavailable`)."""

QUERY_RETRY_S = 1.0
"""Pause between two tries, seconds."""

DEAD_NODE_STATES = frozenset({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "UNKNOWN"})
"""``scontrol show node`` state words (base state or flag) of a node that cannot run a step."""

JOB_PURGED = "PURGED"
"""The job state :func:`job_state` returns for a job ``scontrol`` no longer knows."""

Runner = Callable[..., subprocess.CompletedProcess]


class SlurmUnavailable(RuntimeError):
    """A Slurm client failed every try: its answer is unknown (the message says which and why)."""


def slurm_call(
    args: list[str],
    *,
    tries: int = QUERY_TRIES,
    retry_s: float = QUERY_RETRY_S,
    accept: Callable[[subprocess.CompletedProcess], bool] = lambda out: out.returncode == 0,
    run: Runner = subprocess.run,
) -> subprocess.CompletedProcess:
    """Run the Slurm client ``args`` until ``accept`` takes its result (default: exit code 0); the accepted
    ``CompletedProcess`` (text stdout and stderr).

    Raises:
        SlurmUnavailable: no try was accepted (exit code, timeout, or the client missing).
    """
    why = "not run"
    for attempt in range(max(1, tries)):
        if attempt:
            time.sleep(retry_s)
        try:
            out = run(args, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            why = str(err)
        else:
            if accept(out):
                return out
            why = f"exit code {out.returncode}: {(out.stderr or out.stdout).strip() or 'no output'}"
        log.debug("%s failed (try %d/%d): %s", " ".join(args), attempt + 1, tries, why)
    raise SlurmUnavailable(f"`{' '.join(args)}` failed {max(1, tries)} times ({why})")


def step_ids(
    step_name: str, job: str | None = None, *, tries: int = QUERY_TRIES, run: Runner = subprocess.run
) -> list[str]:
    """The ids (``JOB.STEP``) of the running steps named ``step_name`` (of ``job`` if given); empty when ``squeue``
    lists none (it ended, or never started).

    Raises:
        SlurmUnavailable: ``squeue`` failed every try (unknown: not the same as ended).
    """
    args = ["squeue", "--steps", "--noheader", "--format=%i %j", *([f"--jobs={job}"] if job else [])]
    out = slurm_call(args, tries=tries, run=run)
    return [line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == [step_name]]


def cancel_step(step: str, sig: str, *, run: Runner = subprocess.run) -> None:
    """``scancel --signal=SIG STEP`` (``sig`` without ``SIG``, e.g. ``TERM``; ``step``: ``JOB.STEP``), one try.

    Raises:
        SlurmUnavailable: scancel failed or is missing.
    """
    slurm_call(["scancel", f"--signal={sig}", step], tries=1, run=run)


def node_state(node: str, *, tries: int = QUERY_TRIES, run: Runner = subprocess.run) -> frozenset[str]:
    """The state words of ``node`` (``scontrol show node``'s ``State=IDLE+DRAIN`` -> ``{"IDLE", "DRAIN"}``).

    Raises:
        SlurmUnavailable: scontrol failed every try, or printed no ``State=``.
    """
    out = slurm_call(["scontrol", "show", "node", node, "-o"], tries=tries, run=run)
    found = re.search(r"\bState=([A-Z_+*]+)", out.stdout)
    if not found:
        raise SlurmUnavailable(f"`scontrol show node {node} -o` printed no State=: {out.stdout.strip()[:200]!r}")
    return frozenset(w for w in found.group(1).rstrip("*").split("+") if w)


def node_dead(states: frozenset[str]) -> bool:
    """Whether a node in ``states`` (:func:`node_state`) cannot run a step (:data:`DEAD_NODE_STATES`)."""
    return bool(states & DEAD_NODE_STATES)


def job_state(job: str, *, tries: int = QUERY_TRIES, run: Runner = subprocess.run) -> str:
    """``JobState`` of Slurm job ``job`` (``RUNNING``, ``NODE_FAIL``, ...), or :data:`JOB_PURGED` for an invalid id.

    Raises:
        SlurmUnavailable: scontrol failed every try for another reason, or printed no ``JobState=``.
    """
    out = slurm_call(
        ["scontrol", "show", "job", job, "-o"],
        tries=tries,
        run=run,
        accept=lambda o: o.returncode == 0 or "Invalid job id" in o.stderr,
    )
    if out.returncode != 0:
        return JOB_PURGED
    found = re.search(r"\bJobState=([A-Z_]+)", out.stdout)
    if not found:
        raise SlurmUnavailable(f"`scontrol show job {job} -o` printed no JobState=: {out.stdout.strip()[:200]!r}")
    return found.group(1)
