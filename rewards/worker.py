"""Reward/advantage workers: score a whole group, compute its group-relative advantages.

:class:`RewardWorker` is the socket-free logic (one :class:`bus.messages.RolloutGroup` in, one
:class:`bus.messages.ScoredGroup` out); its process is :class:`rewards.proc.RewardWorkerProc`.

Rewards: a group is scored with the reward functions of its task (``group.task``, looked up in the
reward spec :func:`tasks.registry.reward_spec`: the training task and every eval task). Each
function's raw score goes to ``reward_terms[name]`` (``name`` from :func:`tasks.rewards.reward_name`)
and the reward is ``sum_k weight_k * score_k``. The functions run in child processes by default
(``rewards.isolate``, see :mod:`rewards.scorers`): a call that raises, hangs past
``rewards.timeout_s``, crashes or returns NaN scores 0 for that term only, counted in
``rlbus_rewards_errors_total{error=...}``, and the worker goes on. A group of a task the worker does
not know scores 0 everywhere (error ``"unknown_task"``, one count per sample); with
``filters.skip_verification`` no function is called and every reward is 0. A multi-turn group's
environment rewards (``env_rewards``, scored in the producer's isolated environment children) are
added as the term ``env`` with weight 1. A TRL-style function (reference ``trl:...``, see
:mod:`tasks.trl_rewards`) is called once per group with TRL's keyword arguments; what it logs with
``log_metric(name, value)`` becomes the term ``<function>/<name>`` (the group's mean for every sample,
weight 0: logged as ``reward/<function>/<name>``, a step's mean over its groups as in TRL).

Overlong shaping (``rewards.overlong``, :mod:`rewards.shaping`): a training group's rewards then get
``penalty * R(|y|)``, DAPO's soft overlong punishment of each completion's length (the term
``overlong``, its score in [-1, 0]), before the filters and the advantages; the penalized samples
are counted in ``rlbus_rewards_overlong_total{zone}`` (``soft``: inside the buffer, ``hard``: past
``max_tokens``). Eval groups are not shaped. Training groups whose final rewards are all equal (no
learning signal, whatever the reward) are counted in ``rlbus_rewards_zero_variance_groups_total``;
the packer drops them with ``packer.filter_equal_rewards``.

Filters (:mod:`rewards.filters`) then flag degenerate samples (``flags``; ``masked`` when enforced,
counted in ``rlbus_rewards_filtered_total{filter}``). Advantages are computed on the rewards of the
whole group, flagged samples included (their reward is kept for the baseline).
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
    """Scores groups with their task's weighted reward functions, runs the filters, computes advantages.

    Args:
        rewards: the reward spec ``{task name: ((reward ref, weight), ...)}`` (see
            :func:`tasks.registry.reward_spec`); refs are registry names or import paths, see
            :func:`tasks.rewards.get_reward_fn`. Every distinct ref is resolved at start.
        advantage: the advantage estimator, a built-in name or an import path
            ``"package.module:function"``, resolved once here (see
            :func:`rewards.advantages.resolve_advantage_fn`).
        eps: added to the std by ``"grpo"``, see :func:`rewards.advantages.compute_advantages`.
        name: this worker's name, recorded in each scored group.
        isolate: run the reward functions in child processes (:class:`rewards.scorers.IsolatedScorer`;
            call :meth:`close`); False: in this process, without timeout or crash protection.
        timeout_s, num_procs: see :class:`rewards.scorers.IsolatedScorer` (``isolate`` only).
        filters: the ``filters`` config section (default: all off).
        overlong: the ``rewards.overlong`` section with ``max_tokens`` resolved (the run's
            ``sampling.max_tokens`` when the config leaves it null, :func:`rewards.shaping.overlong_section`),
            or None: no shaping.
        max_steps: ``trainer.max_steps``, the ``trainer_state.max_steps`` of TRL-style functions.

    Raises:
        ValueError: unknown reward function or advantage estimator, an import path that does
            not import or is not callable, two reward functions of one task with the same name
            (their ``reward_terms`` would collide), a reward function named ``overlong`` while the
            shaping is on, or ``overlong`` without ``max_tokens``.
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
    ) -> None:
        self.advantage = resolve_advantage_fn(advantage)  # before the scorer: fail fast, no children left
        self.filters = filters or FiltersConfig()
        if overlong is not None and overlong.max_tokens is None:
            raise ValueError(
                "overlong shaping needs max_tokens: pass the section with max_tokens set (sampling.max_tokens by default)"
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
                        f"task {task!r}: two reward functions are named {term.name!r}; reward_terms needs distinct names"
                    )
                if overlong is not None and term.name == OVERLONG_TERM:
                    raise ValueError(
                        f"task {task!r}: a reward function is named {OVERLONG_TERM!r}, the term of rewards.overlong; rename it"
                    )
                self.tasks[task].append(term)
        self.scorer: InProcessScorer | IsolatedScorer | None = None
        if refs and not self.filters.skip_verification:
            self.scorer = (
                IsolatedScorer(refs, timeout_s=timeout_s, num_procs=num_procs) if isolate else InProcessScorer(refs)
            )
        self.eps = eps
        self.name = name

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """Rewards ``[G] float32`` (weighted sum of the task's reward functions), ``reward_terms``
        (each function's ``[G]`` scores), filter ``flags``/``masked`` and advantages ``[G] float32``.

        A failed reward call scores 0 for its term and is counted by error label; a group of an
        unknown task scores 0; never raises for either.

        Raises:
            ValueError: a custom advantage function returned a wrong shape or non-finite values (a
                bug in that function, not in the data: the process boundary reports it).
        """
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
                reward_terms[term.name] = result.rewards
                for metric, value in result.metrics.items():  # TRL's log_metric: logged, not added to the reward
                    reward_terms[f"{term.name}/{metric}"] = [value] * g
                total += term.weight * np.asarray(result.rewards, np.float64)
        if len(group.env_rewards):  # a multi-turn episode's environment reward (producers.episodes)
            reward_terms["env"] = [float(r) for r in group.env_rewards]
            total += np.asarray(group.env_rewards, np.float64)
        ids, lps, lens = group.completion_ids, group.sampler_logprobs, group.completion_lens
        if len(
            group.loss_mask
        ):  # filters and shaping judge the model's tokens only (environment tokens have logprob 0)
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
        """The group as TRL's batch (:func:`tasks.trl_rewards.trl_batch`): prompt text and chat
        messages, each sample's token ids, the step its prompt was issued for."""
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
        """``[G] float64`` penalty * R(|y|) to add to the rewards (:mod:`rewards.shaping`); records the
        term ``overlong`` (R itself) and counts the penalized samples by zone."""
        assert self.overlong is not None and self.overlong.max_tokens is not None
        max_tokens, buffer_tokens = self.overlong.max_tokens, self.overlong.buffer_tokens
        score = soft_overlong_punishment(lens, max_tokens, buffer_tokens)
        reward_terms[OVERLONG_TERM] = score.tolist()
        for zone, count in overlong_zone_counts(lens, max_tokens, buffer_tokens).items():
            OVERLONG.labels(zone).inc(count)
        return self.overlong.penalty * score

    def close(self) -> None:
        """Stop the reward functions' child processes (if isolated); idempotent."""
        if self.scorer is not None:
            self.scorer.close()
