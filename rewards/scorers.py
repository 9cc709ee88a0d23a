"""Reward isolation: run reward functions in child processes, so a bad one costs a sample, not a worker.

A reward function is user code (a verifier, a sandbox call, a regex over model output). One that
raises, hangs, runs past ``timeout_s``, crashes its interpreter (``os._exit``, a segfault) or returns
NaN must score that sample 0 with the reason counted, and the reward worker must live on.

:class:`IsolatedScorer` runs the calls on a pool of child processes of its own,
:class:`tasks.isolated_calls.IsolatedCalls` (the same machinery runs the producers' environments; its
docstring has the protocol, the per-call deadlines, the kill-and-replace of a stuck or dead child
and the parent-death signal). Here: one call per (reward function, sample) with arguments
``(completion, info)``, resolved by :func:`tasks.rewards.get_float_reward_fn` (so a non-float
result fails inside the child as ``TypeError``/``ValueError``).

Invariants and choices:

* **Several functions, resolved once.** A scorer is given the list of every reward function its
  worker may need (all tasks' functions); each child resolves the whole list at start, and each
  call names the function by its index in that list.
* **Per-call work, each with its own deadline**: only the call that overran is zeroed, the sample
  keeps the scores of its other functions. A group of G samples and K functions takes at most about
  ``ceil(K * G / num_procs) * timeout_s`` even if every call hangs.
* **Error labels:** the exception type name (``"ValueError"``), ``"timeout"``, ``"crash"``,
  ``"non_finite"``. The scorer returns them per call; :class:`rewards.worker.RewardWorker` counts
  them in ``rlbus_rewards_errors_total{error=...}``.

:class:`InProcessScorer` has the same interface and calls the function directly (no timeout, no
crash protection; exceptions and NaN still score 0): for tests and benchmarks (``rewards.isolate: false``).

**TRL-style functions** (references ``trl:...``/``trl_conversational:...``, :mod:`tasks.trl_rewards`)
score the whole group in one call, with arguments ``(completions, info, batch)`` (``batch``: the
prompt text and chat messages, token ids and step, :func:`tasks.trl_rewards.trl_batch`). A failed call (raised, timed out,
crashed, wrong number of rewards) fails the term for every sample of the group with its label; a
``None`` reward scores 0 without an error (TRL: not applicable); NaN is ``non_finite`` as above. The
metrics such a function logs with ``log_metric`` come back in :attr:`GroupScore.metrics`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from tasks.isolated_calls import CallResult, IsolatedCalls, check_refs
from tasks.rewards import get_float_reward_fn
from tasks.trl_rewards import split_trl_ref

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GroupScore:
    """Scores of one reward function on one group: ``rewards[i]`` (0.0 where ``errors[i]`` is set) and
    ``errors[i]`` (``None`` or the error label of sample i: exception type, ``"timeout"``, ``"crash"``,
    ``"non_finite"``); ``metrics``: what a TRL-style function logged (``{name: mean}``), else empty."""

    rewards: list[float]
    errors: list[str | None]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def _finite(value: float) -> tuple[float, str | None]:
    """``(value, None)`` for a finite reward, ``(0.0, "non_finite")`` for NaN or +-inf."""
    return (value, None) if math.isfinite(value) else (0.0, "non_finite")


def _check_refs(reward_fns: Sequence[str]) -> tuple[str, ...]:
    """The reward references as a tuple; ``TypeError`` for a bare string (it would be read as
    characters), ``ValueError`` for an empty list."""
    return check_refs(reward_fns, "reward function")


def _group_score(result: CallResult, g: int) -> GroupScore:
    """The :class:`GroupScore` of one TRL-style call on a group of ``g`` samples (see the module docstring)."""
    if result.error is not None:
        return GroupScore([0.0] * g, [result.error] * g)
    pairs = [(0.0, None) if r is None else _finite(float(r)) for r in result.value["rewards"]]
    metrics = {str(k): float(v) for k, v in result.value.get("metrics", {}).items()}
    return GroupScore([p[0] for p in pairs], [p[1] for p in pairs], metrics)


def _trl_flags(refs: Sequence[str]) -> list[bool]:
    """Per reward reference: whether it is TRL-style (called once per group with the batch)."""
    return [split_trl_ref(ref)[0] is not None for ref in refs]


def _check_batch(trl: Sequence[bool], indices: Sequence[int], batch: dict[str, Any] | None) -> None:
    """ValueError when a TRL-style function (``trl[k]``) is asked for without its ``batch``."""
    if batch is None and any(trl[k] for k in indices):
        raise ValueError("a TRL-style reward function needs the group's batch (tasks.trl_rewards.trl_batch)")


def _fn_indices(fns: Sequence[int] | None, num_fns: int) -> list[int]:
    """``fns`` checked against ``num_fns`` (``None``: all of them)."""
    indices = list(range(num_fns)) if fns is None else list(fns)
    bad = [k for k in indices if not 0 <= k < num_fns]
    if bad:
        raise ValueError(f"reward function indices {bad} out of range: this scorer has {num_fns}")
    return indices


class InProcessScorer:
    """Calls the reward functions in this process: exceptions and NaN score 0, hangs and crashes don't
    (no isolation). Same interface as :class:`IsolatedScorer`.

    Raises:
        TypeError, ValueError: ``reward_fns`` is a string or empty, or names an unknown reward or
            import path.
    """

    def __init__(self, reward_fns: Sequence[str]) -> None:
        self.reward_fns = _check_refs(reward_fns)
        self._fns = [get_float_reward_fn(ref) for ref in self.reward_fns]
        self._trl = _trl_flags(self.reward_fns)

    def score(
        self,
        completions: Sequence[str],
        info: dict[str, Any],
        fns: Sequence[int] | None = None,
        *,
        batch: dict[str, Any] | None = None,
    ) -> list[GroupScore]:
        """One :class:`GroupScore` per index in ``fns`` (default: every function), in that order;
        ``batch`` is needed by TRL-style functions (:func:`tasks.trl_rewards.trl_batch`).

        Raises:
            ValueError: an index out of range, or a TRL-style function without ``batch``.
        """
        indices = _fn_indices(fns, len(self._fns))
        _check_batch(self._trl, indices, batch)
        out = []
        for k in indices:
            if self._trl[k]:
                try:
                    result = CallResult(self._fns[k](list(completions), info, batch), None)
                except Exception as exc:
                    log.warning(
                        "TRL-style reward function %s raised: %s: %.300s; its rewards set to 0",
                        self.reward_fns[k],
                        type(exc).__name__,
                        exc,
                    )
                    result = CallResult(None, type(exc).__name__)
                out.append(_group_score(result, len(completions)))
                continue
            rewards: list[float] = []
            errors: list[str | None] = []
            for i, text in enumerate(completions):
                try:
                    reward, error = _finite(self._fns[k](text, info))
                except Exception as exc:
                    log.warning(
                        "reward function %s raised on sample %d: %s: %.300s; reward set to 0",
                        self.reward_fns[k],
                        i,
                        type(exc).__name__,
                        exc,
                    )
                    reward, error = 0.0, type(exc).__name__
                rewards.append(reward)
                errors.append(error)
            out.append(GroupScore(rewards, errors))
        return out

    def close(self) -> None:
        """Nothing to release."""


class IsolatedScorer:
    """Scores groups with reward functions that run in ``num_procs`` child processes
    (:class:`tasks.isolated_calls.IsolatedCalls`).

    Args:
        reward_fns: registry names or ``"package.module:function"`` paths, every one resolved in
            each child at its start; :meth:`score` names them by index.
        timeout_s: most seconds one reward call may take; past it that call scores 0
            (``"timeout"``) and its child is killed and replaced.
        num_procs: child processes; the calls of a group are made in parallel across them.

    Raises:
        TypeError: ``reward_fns`` is a string, not a list.
        ValueError: bad arguments, or the children cannot resolve one of ``reward_fns`` (the
            child's error, e.g. an unknown name or a failed import, is in the message).
        RuntimeError: a child did not start (or restart) within ``START_TIMEOUT_S``.
    """

    def __init__(self, reward_fns: Sequence[str], *, timeout_s: float = 5.0, num_procs: int = 2) -> None:
        self.reward_fns = _check_refs(reward_fns)
        self._trl = _trl_flags(self.reward_fns)
        self._calls = IsolatedCalls(
            self.reward_fns,
            resolver="tasks.rewards:get_float_reward_fn",
            timeout_s=timeout_s,
            num_procs=num_procs,
            what="reward function",
        )
        self.timeout_s = self._calls.timeout_s

    def __enter__(self) -> IsolatedScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Process ids of the live children (for tests and logs)."""
        return self._calls.pids()

    def score(
        self,
        completions: Sequence[str],
        info: dict[str, Any],
        fns: Sequence[int] | None = None,
        *,
        batch: dict[str, Any] | None = None,
    ) -> list[GroupScore]:
        """Scores of one group: one :class:`GroupScore` per index in ``fns`` (default: every
        function), in that order. Never raises for a failing reward function (see the module
        docstring). ``batch`` is needed by TRL-style functions (:func:`tasks.trl_rewards.trl_batch`).

        Raises:
            ValueError: an index in ``fns`` is out of range, or a TRL-style function without ``batch``.
        """
        indices = _fn_indices(fns, len(self.reward_fns))
        _check_batch(self._trl, indices, batch)
        n = len(completions)
        trl = [self._trl[k] for k in indices]
        calls = []  # every function's calls, in order: one per sample, or one per group (TRL-style)
        for k, whole_group in zip(indices, trl):
            calls += (
                [(k, [list(completions), info, batch])]
                if whole_group
                else [(k, [completions[i], info]) for i in range(n)]
            )
        results = self._calls.run(calls)
        out = []
        for whole_group in trl:
            if whole_group:
                out.append(_group_score(results.pop(0), n))
                continue
            pairs = [(0.0, r.error) if r.error is not None else _finite(r.value) for r in results[:n]]
            del results[:n]
            out.append(GroupScore([p[0] for p in pairs], [p[1] for p in pairs]))
        return out

    def close(self) -> None:
        """Stop every child (asked first, then SIGKILL after ``STOP_TIMEOUT_S``); idempotent."""
        self._calls.close()
