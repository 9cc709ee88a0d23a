"""Online evaluation results, socket-free: scored eval groups (``ScoredGroup.is_eval``, never trained)
and failed ones (announced in ``groups.dropped``, ids :func:`bus.eval_ids.parse_eval_id`) are counted
per round; once received + failed reach the round's ``eval_size``, :class:`EvalAggregator` closes it
with one :class:`bus.messages.EvalResult` per task (:func:`eval_metrics`). A round closes at most
once, a group counts once (received wins over failed), and a group of a closed round is ``late``; a
round whose groups all failed never learns its size and never closes. Durable state:
:mod:`packer.eval_spool`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from bus.eval_ids import parse_eval_id
from bus.messages import EvalResult, ScoredGroup, new_id

__all__ = ["EvalAggregator", "EvalGroup", "RoundResult", "eval_metrics", "parse_eval_id", "summarize"]


@dataclass(frozen=True)
class EvalGroup:
    """What the metrics need of one scored eval group of ``G`` completions: rewards ``[G] float64``,
    completion lengths ``[G] int64``, each reward function's ``G`` scores, and the oldest first-token
    and newest last-token policy versions."""

    rewards: np.ndarray
    completion_lens: np.ndarray
    reward_terms: dict[str, list[float]]
    version_min: int
    version_max: int


def eval_metrics(groups: list[EvalGroup]) -> dict[str, float]:
    """The metrics of one task in one round over its ``n`` completions (float64; ``{}`` for none):
    ``reward_mean``, ``reward_std`` (population), ``completion_len_mean`` (tokens), ``reward/<name>``
    (mean of that function's scores where present), and ``pass_at_<k>`` per group size ``k``: the
    share of examples with a completion of reward >= 1, which for ``n = k`` samples is the unbiased
    pass@k estimator ``1 - C(n - c, k) / C(n, k)`` of Chen et al. 2021 (arXiv:2107.03374)."""
    rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
    if not len(rewards):
        return {}
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "completion_len_mean": float(np.concatenate([g.completion_lens for g in groups]).mean()),
    }
    for name in sorted({n for g in groups for n in g.reward_terms}):
        scores = [s for g in groups for s in g.reward_terms.get(name, [])]
        metrics[f"reward/{name}"] = float(np.mean(scores))
    for k in sorted({len(g.rewards) for g in groups if len(g.rewards)}):
        solved = [bool((g.rewards >= 1.0).any()) for g in groups if len(g.rewards) == k]
        metrics[f"pass_at_{k}"] = float(np.mean(solved))
    return metrics


def summarize(group: ScoredGroup) -> EvalGroup:
    """The :class:`EvalGroup` of a scored eval group (float64/int64 copies)."""
    return EvalGroup(
        rewards=np.asarray(group.rewards, np.float64),
        completion_lens=np.asarray(group.completion_lens, np.int64),
        reward_terms={name: list(map(float, scores)) for name, scores in group.reward_terms.items()},
        version_min=int(group.version_start.min()),
        version_max=int(group.version_end.max()),
    )


@dataclass(frozen=True)
class RoundResult:
    """A closed eval round: one result per task, and the received group ids to release."""

    round: int
    results: list[EvalResult]
    group_ids: list[str]


@dataclass
class _Round:
    size: int = 0  # eval_size, 0 while no group of the round has arrived
    received: dict[str, tuple[str, EvalGroup]] = field(default_factory=dict)  # id -> (task, summary)
    failed: dict[str, str] = field(default_factory=dict)  # id -> task

    def complete(self) -> bool:
        return self.size > 0 and len(self.received) + len(self.failed) >= self.size


class EvalDecision(StrEnum):
    """What became of a received eval group: the ``outcome`` label of ``rlbus_packer_eval_groups_total``."""

    TAKEN = "taken"
    """Held until its round closes (:meth:`EvalAggregator.add`)."""
    DUPLICATE = "duplicate"
    """Its id is already held: the round's release covers it."""
    LATE = "late"
    """Its round is closed: released at once, it changes nothing."""
    INVALID = "invalid"
    """Malformed (:meth:`EvalAggregator.add` raised): ignored by :mod:`packer.proc`, so training goes on."""


class EvalAggregator:
    """Collects eval groups and failures per round; closes a round when all its groups are in."""

    def __init__(self) -> None:
        self.rounds: dict[int, _Round] = {}
        self.closed: set[int] = set()

    def add(self, group: ScoredGroup) -> tuple[EvalDecision, RoundResult | None]:
        """Take a scored eval group: ``(decision, closed)``, the round it completed or None. ValueError if it is
        not an eval group or its ``eval_size`` disagrees with the round's."""
        if not group.is_eval or group.eval_size < 1:
            raise ValueError(
                f"group {group.id} is not an eval group (eval_round {group.eval_round}, eval_size {group.eval_size})"
            )
        r = group.eval_round
        if r in self.closed:
            return EvalDecision.LATE, None
        state = self.rounds.setdefault(r, _Round())
        if state.size and state.size != group.eval_size:
            raise ValueError(
                f"eval group {group.id} says round {r} has {group.eval_size} groups, earlier ones said {state.size}"
            )
        if group.id in state.received:
            return EvalDecision.DUPLICATE, None
        return EvalDecision.TAKEN, self.take(r, group.eval_size, group.id, group.task, summarize(group))

    def take(self, round_: int, size: int, group_id: str, task: str, summary: EvalGroup) -> RoundResult | None:
        """Count a received group of an open round (after :meth:`add`'s checks, or replayed); the round if closed."""
        state = self.rounds.setdefault(round_, _Round())
        state.size = size
        state.failed.pop(group_id, None)
        state.received[group_id] = (task, summary)
        return self._close_if_complete(round_)

    def is_new_failure(self, group_id: str) -> bool:
        """Whether ``group_id`` is an eval id of an open round not counted yet."""
        parsed = parse_eval_id(group_id)
        if parsed is None or parsed[0] in self.closed:
            return False
        state = self.rounds.get(parsed[0])
        return state is None or (group_id not in state.received and group_id not in state.failed)

    def forget_above(self, round_: int) -> None:
        """Forget every round ``> round_``, open or closed (a resume at checkpoint ``round_``)."""
        self.rounds = {r: s for r, s in self.rounds.items() if r <= round_}
        self.closed = {r for r in self.closed if r <= round_}

    def add_failed(self, group_ids: list[str]) -> list[RoundResult]:
        """Count the eval ids among ``group_ids`` as failed (others ignored); returns the rounds closed."""
        touched = set()
        for gid in group_ids:
            parsed = parse_eval_id(gid)
            if parsed is None or parsed[0] in self.closed:
                continue
            r, task = parsed
            state = self.rounds.setdefault(r, _Round())
            if gid not in state.received:
                state.failed[gid] = task
                touched.add(r)
        return [res for r in sorted(touched) if (res := self._close_if_complete(r)) is not None]

    def _close_if_complete(self, r: int) -> RoundResult | None:
        state = self.rounds[r]
        if not state.complete():
            return None
        del self.rounds[r]
        self.closed.add(r)
        tasks = sorted({task for task, _ in state.received.values()} | set(state.failed.values()))
        results = []
        for task in tasks:
            groups = [g for t, g in state.received.values() if t == task]
            results.append(
                EvalResult(
                    id=new_id(),
                    round=r,
                    task=task,
                    version_min=min((g.version_min for g in groups), default=r),
                    version_max=max((g.version_max for g in groups), default=r),
                    num_samples=int(sum(len(g.rewards) for g in groups)),
                    num_failed=sum(1 for t in state.failed.values() if t == task),
                    metrics=eval_metrics(groups),
                )
            )
        return RoundResult(round=r, results=results, group_ids=sorted(state.received))
