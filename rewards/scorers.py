"""Reward scorers: a group's reward function calls made in isolated children (:class:`IsolatedScorer`,
over :class:`tasks.isolated_calls.IsolatedCalls`) or in this process (:class:`InProcessScorer`, no
timeout or crash protection; ``rewards.isolate: false``). A failed call scores 0 with its error label
(exception type, ``"timeout"``, ``"crash"``, ``"non_finite"``); a TRL-style function's call covers the
whole group (a ``None`` reward scores 0 without error). See docs/ARCHITECTURE.md, "Failure containment".
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
    """One function on one group: ``rewards`` ``[G]`` (0.0 where ``errors[i]``, the label, is set),
    ``metrics``, what a TRL-style function logged (``{name: mean}``), and ``message``, the first failure's."""

    rewards: list[float]
    errors: list[str | None]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    message: str = ""


NON_FINITE_MESSAGE = "returned a non-finite reward (NaN or inf)"


def _finite(value: float) -> tuple[float, str | None]:
    """``(value, None)``, or ``(0.0, "non_finite")`` for NaN or inf."""
    return (value, None) if math.isfinite(value) else (0.0, "non_finite")


def _first_message(errors: Sequence[str | None], messages: Sequence[str]) -> str:
    """The message of the first failed call (:data:`NON_FINITE_MESSAGE` for a non-finite value)."""
    for error, message in zip(errors, messages):
        if error is not None:
            return message or (NON_FINITE_MESSAGE if error == "non_finite" else error)
    return ""


def _check_refs(reward_fns: Sequence[str]) -> tuple[str, ...]:
    """As :func:`tasks.isolated_calls.check_refs`."""
    return check_refs(reward_fns, "reward function")


def _group_score(result: CallResult, g: int) -> GroupScore:
    """The :class:`GroupScore` of one TRL-style call on ``g`` samples."""
    if result.error is not None:
        return GroupScore([0.0] * g, [result.error] * g, message=result.message)
    pairs = [(0.0, None) if r is None else _finite(float(r)) for r in result.value["rewards"]]
    metrics = {str(k): float(v) for k, v in result.value.get("metrics", {}).items()}
    errors = [p[1] for p in pairs]
    return GroupScore([p[0] for p in pairs], errors, metrics, _first_message(errors, [""] * g))


def _trl_flags(refs: Sequence[str]) -> list[bool]:
    """Per reference: whether it is TRL-style."""
    return [split_trl_ref(ref)[0] is not None for ref in refs]


def _check_batch(trl: Sequence[bool], indices: Sequence[int], batch: dict[str, Any] | None) -> None:
    """ValueError for a TRL-style function without ``batch``."""
    if batch is None and any(trl[k] for k in indices):
        raise ValueError("a TRL-style reward function needs the group's batch (tasks.trl_rewards.trl_batch)")


def _fn_indices(fns: Sequence[int] | None, num_fns: int) -> list[int]:
    """``fns`` checked against ``num_fns`` (None: all)."""
    indices = list(range(num_fns)) if fns is None else list(fns)
    bad = [k for k in indices if not 0 <= k < num_fns]
    if bad:
        raise ValueError(f"reward function indices {bad} out of range: this scorer has {num_fns}")
    return indices


class InProcessScorer:
    """:class:`IsolatedScorer`'s interface in this process: exceptions and NaN score 0, hangs and crashes
    are not contained. TypeError/ValueError for bad or unknown ``reward_fns``."""

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
        """As :meth:`IsolatedScorer.score`."""
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
                    result = CallResult(None, type(exc).__name__, str(exc))
                out.append(_group_score(result, len(completions)))
                continue
            rewards: list[float] = []
            errors: list[str | None] = []
            messages: list[str] = []
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
                    messages.append(str(exc))
                else:
                    messages.append("")
                rewards.append(reward)
                errors.append(error)
            out.append(GroupScore(rewards, errors, message=_first_message(errors, messages)))
        return out

    def close(self) -> None:
        """Nothing to release."""


class IsolatedScorer:
    """Reward functions ``reward_fns`` (names or import paths, resolved in each child, named by index
    in :meth:`score`) in ``num_procs`` children; ``timeout_s`` bounds one call, seconds. Errors as
    :class:`tasks.isolated_calls.IsolatedCalls`."""

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
        """Process ids of the live children."""
        return self._calls.pids()

    def score(
        self,
        completions: Sequence[str],
        info: dict[str, Any],
        fns: Sequence[int] | None = None,
        *,
        batch: dict[str, Any] | None = None,
    ) -> list[GroupScore]:
        """One :class:`GroupScore` per index in ``fns`` (default all), in order; never raises for a failing
        function. ``batch``: :func:`tasks.trl_rewards.trl_batch`, for TRL-style functions. ValueError
        for an index out of range or a missing ``batch``."""
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
            errors = [p[1] for p in pairs]
            message = _first_message(errors, [r.message for r in results[:n]])
            del results[:n]
            out.append(GroupScore([p[0] for p in pairs], errors, message=message))
        return out

    def close(self) -> None:
        """Stop every child; idempotent."""
        self._calls.close()
