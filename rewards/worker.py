"""Reward workers: :class:`RewardWorker` scores a whole group with its task's weighted reward
functions, applies the overlong shaping and the filters, and computes the group's advantages (one
:class:`bus.messages.RolloutGroup` in, one :class:`bus.messages.ScoredGroup` out; the process is
:mod:`rewards.proc`). Each function's score is ``reward_terms[name]``; a multi-turn group's
``env_rewards`` join as the term ``env``; a TRL-style function's logged metrics as weight-0 terms
``<function>/<name>``. A failed call or an unknown task scores 0, counted in
``rlbus_rewards_errors_total{error}`` and, per function, in the worker's
:class:`telemetry.failure_window.FailureWindows` (the console warning, the stop). The rules:
docs/ARCHITECTURE.md, "Tasks, reward terms and filters".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import numpy as np
from prometheus_client import Counter

from bus.messages import RolloutGroup, ScoredGroup
from configs.rollout import OverlongConfig
from configs.schema import FiltersConfig
from rewards.advantages import compute_advantages, resolve_advantage_fn
from rewards.filters import FILTER_NAMES, apply_filters
from rewards.scorers import InProcessScorer, IsolatedScorer
from rewards.shaping import OVERLONG_TERM, OVERLONG_ZONES, overlong_zone_counts, soft_overlong_punishment
from tasks.rewards import reward_name
from tasks.trl_rewards import split_trl_ref, trl_batch
from telemetry.failure_window import FailureWindows, outcomes

log = logging.getLogger(__name__)

REWARD_ERRORS = Counter(
    "rlbus_rewards_errors_total",
    "Reward function calls that failed (reward set to 0), by error: the exception type, timeout, crash, "
    "non_finite, or unknown_task (one per sample of a group whose task has no rewards here)",
    ["error"],
)
for _error in ("timeout", "crash", "non_finite", "unknown_task"):  # exception type names appear when raised
    REWARD_ERRORS.labels(_error)
FILTERED = Counter(
    "rlbus_rewards_filtered_total", "Samples flagged by a filter (masked if it is enforced), by filter", ["filter"]
)
for _filter in FILTER_NAMES:  # every filter's series exists from the start (at 0 while it is off)
    FILTERED.labels(_filter)
OVERLONG = Counter(
    "rlbus_rewards_overlong_total",
    "Training samples penalized by the overlong shaping (rewards.overlong), by zone: soft (inside the buffer, "
    "linear penalty) or hard (longer than max_tokens, the whole penalty)",
    ["zone"],
)
for _zone in OVERLONG_ZONES:
    OVERLONG.labels(_zone)
ZERO_VARIANCE = Counter(
    "rlbus_rewards_zero_variance_groups_total",
    "Training groups whose rewards (shaping included) are all equal: zero advantage, no policy gradient "
    "(TRL's frac_reward_zero_std); packer.filter_equal_rewards drops them",
)


@dataclasses.dataclass(frozen=True)
class _Term:
    fn: int  # index in the scorer's list of reward functions
    name: str  # reward_terms key
    weight: float
    trl: bool  # a TRL-style function: needs the group's batch


class RewardWorker:
    """``rewards``: the reward spec (:func:`tasks.registry.reward_spec`), every distinct ref resolved at
    start; ``advantage``, ``eps``: :func:`rewards.advantages.compute_advantages`; ``isolate``,
    ``timeout_s``, ``num_procs``: :class:`rewards.scorers.IsolatedScorer` (call :meth:`close`);
    ``overlong``: :func:`rewards.shaping.overlong_section`, None for no shaping; ``max_steps``: TRL's;
    ``failures``: where each function's call outcomes are recorded (None: nowhere).

    Raises:
        ValueError: an unknown reward or estimator, two functions of one task with the same name, one
            named ``overlong`` while shaping, or ``overlong`` without ``max_tokens``.
    """

    def __init__(
        self,
        rewards: Mapping[str, Sequence[tuple[str, float]]],
        *,
        advantage: str = "grpo",
        eps: float = 1e-6,
        name: str,
        isolate: bool = True,
        timeout_s: float = 5.0,
        num_procs: int = 2,
        filters: FiltersConfig | None = None,
        overlong: OverlongConfig | None = None,
        max_steps: int = 0,
        failures: FailureWindows | None = None,
    ) -> None:
        self.advantage = resolve_advantage_fn(advantage)  # before the scorer: fail fast, no children left
        self.filters = filters or FiltersConfig()
        if overlong is not None and overlong.max_tokens is None:
            raise ValueError(
                "overlong shaping needs max_tokens: pass the section with max_tokens set "
                "(sampling.max_tokens by default)"
            )
        self.overlong = overlong
        self.max_steps = max_steps
        refs: list[str] = []
        self.tasks: dict[str, list[_Term]] = {}
        for task, terms in rewards.items():
            self.tasks[task] = []
            for ref, weight in terms:
                if ref not in refs:  # each distinct function once in the children, whatever tasks share it
                    refs.append(ref)
                term = _Term(refs.index(ref), reward_name(ref), float(weight), split_trl_ref(ref)[0] is not None)
                if term.name in {t.name for t in self.tasks[task]}:
                    raise ValueError(
                        f"task {task!r}: two reward functions are named {term.name!r}; "
                        "reward_terms needs distinct names"
                    )
                if overlong is not None and term.name == OVERLONG_TERM:
                    raise ValueError(
                        f"task {task!r}: a reward function is named {OVERLONG_TERM!r}, "
                        "the term of rewards.overlong; rename it"
                    )
                self.tasks[task].append(term)
        self.scorer: InProcessScorer | IsolatedScorer | None = None
        if refs and not self.filters.skip_verification:
            self.scorer = (
                IsolatedScorer(refs, timeout_s=timeout_s, num_procs=num_procs) if isolate else InProcessScorer(refs)
            )
        self.eps = eps
        self.name = name
        self.failures = failures

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """The scored group: rewards ``[G] float32``, ``reward_terms``, ``flags``/``masked``, advantages
        ``[G] float32``. Never raises for a failing reward call or an unknown task; ValueError for a
        custom advantage function's bad output."""
        g = group.group_size
        total = np.zeros(g, np.float64)
        reward_terms: dict[str, list[float]] = {}
        terms = self.tasks.get(group.task)
        if self.filters.skip_verification:
            pass
        elif terms is None:
            log.warning(
                "group %s has task %r, which this worker has no rewards for (known: %s); rewards set to 0",
                group.id,
                group.task,
                ", ".join(self.tasks),
            )
            REWARD_ERRORS.labels("unknown_task").inc(g)
        elif terms:
            assert self.scorer is not None
            batch = self._trl_batch(group) if any(t.trl for t in terms) else None
            for term, result in zip(
                terms, self.scorer.score(group.completion_texts, group.info, [t.fn for t in terms], batch=batch)
            ):
                for error in result.errors:
                    if error is not None:
                        REWARD_ERRORS.labels(error).inc()
                if self.failures is not None:
                    self.failures.record("reward", term.name, outcomes(result.errors, result.message))
                reward_terms[term.name] = result.rewards
                for metric, value in result.metrics.items():  # TRL's log_metric: logged, not added to the reward
                    reward_terms[f"{term.name}/{metric}"] = [value] * g
                total += term.weight * np.asarray(result.rewards, np.float64)
        if len(group.env_rewards):  # a multi-turn episode's environment reward (producers.episodes)
            reward_terms["env"] = [float(r) for r in group.env_rewards]
            total += np.asarray(group.env_rewards, np.float64)
        ids, lps, lens = group.completion_ids, group.sampler_logprobs, group.completion_lens
        # filters and shaping judge the model's tokens only (environment tokens have logprob 0)
        if len(group.loss_mask):
            owner = np.repeat(np.arange(g), group.completion_lens)
            ids, lps, lens = (
                ids[group.loss_mask],
                lps[group.loss_mask],
                np.bincount(owner[group.loss_mask], minlength=g),
            )
        if self.overlong is not None and not group.is_eval:
            total += self._overlong(np.asarray(lens, np.int64), reward_terms)
        rewards = total.astype(np.float32)
        overflow = ~np.isfinite(rewards)  # finite scores times finite weights can still overflow float32
        if overflow.any():
            REWARD_ERRORS.labels("non_finite").inc(int(overflow.sum()))
            rewards[overflow] = 0.0
        found = apply_filters(self.filters, ids, lps, lens)
        for filter_name, count in found.counts.items():
            FILTERED.labels(filter_name).inc(count)
        if not group.is_eval and np.all(rewards == rewards[0]):
            ZERO_VARIANCE.inc()
        advantages = compute_advantages(self.advantage, rewards, np.asarray(group.completion_lens, np.int64), self.eps)
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(RolloutGroup)}
        return ScoredGroup(
            **fields,
            reward_worker=self.name,
            rewards=rewards,
            advantages=advantages,
            reward_terms=reward_terms,
            flags=found.flags,
            masked=found.masked,
        )

    def _trl_batch(self, group: RolloutGroup) -> dict:
        """The group as :func:`tasks.trl_rewards.trl_batch`."""
        ids = [group.completion(j)[0].tolist() for j in range(group.group_size)]
        return trl_batch(
            group.prompt_text,
            group.completion_texts,
            ids,
            global_step=group.step,
            max_steps=self.max_steps,
            prompt_messages=group.prompt_messages,
        )

    def _overlong(self, lens: np.ndarray, reward_terms: dict[str, list[float]]) -> np.ndarray:
        """``[G] float64`` penalty * R(|y|); records the term ``overlong`` and counts the zones."""
        assert self.overlong is not None and self.overlong.max_tokens is not None
        max_tokens, buffer_tokens = self.overlong.max_tokens, self.overlong.buffer_tokens
        score = soft_overlong_punishment(lens, max_tokens, buffer_tokens)
        reward_terms[OVERLONG_TERM] = score.tolist()
        for zone, count in overlong_zone_counts(lens, max_tokens, buffer_tokens).items():
            OVERLONG.labels(zone).inc(count)
        return self.overlong.penalty * score

    def close(self) -> None:
        """Stop the scorer's children; idempotent."""
        if self.scorer is not None:
            self.scorer.close()
