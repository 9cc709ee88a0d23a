"""Reward shaping by completion length: DAPO's soft overlong punishment.

A reward worker with ``rewards.overlong`` set adds :func:`soft_overlong_punishment` times the penalty
factor to the reward of every training sample, as the reward term ``overlong`` (its unscaled score,
in [-1, 0]). Truncated completions carry a noisy signal (a correct line of reasoning cut off scores
as wrong); DAPO (Yu et al. 2025, arXiv:2503.14476, Sec. 3.4) first masks them, then instead
punishes length softly inside a buffer before the hard limit, so the policy learns to stay short of
it. The same rule is verl's ``reward_model.overlong_buffer`` (``penalty_factor``), TRL's
``get_soft_overlong_punishment`` and AReaL's/OpenRLHF's overlong penalty.

Choices:

- **Length = the model's own tokens** (``completion_lens``, minus environment tokens in a
  multi-turn episode, whose ``loss_mask`` is False): what the sampler spent its budget on.
- **Training groups only**: an eval group keeps its task reward, so ``eval/<task>/reward_mean``
  stays comparable across runs with and without shaping.
- The shaping acts on the reward, before the advantages, so every advantage estimator and the
  packer's group filters (``packer.filter_equal_rewards``, ``filters.online_difficulty_filtering``)
  see the shaped reward: a group of equally correct answers of different lengths is no longer a
  zero-variance group.
"""

from __future__ import annotations

import numpy as np

from configs.rollout import OverlongConfig
from configs.schema import RunConfig

OVERLONG_TERM = "overlong"
"""The ``reward_terms`` key (and ``reward/<name>`` log) of the overlong score."""

OVERLONG_ZONES = ("soft", "hard")
"""Label values of ``rlbus_rewards_overlong_total``: inside the buffer (linear penalty) or past
``max_tokens`` (the whole penalty)."""


def soft_overlong_punishment(completion_lens: np.ndarray, max_tokens: int, buffer_tokens: int) -> np.ndarray:
    """DAPO's length-aware penalty of each completion, before the penalty factor.

        R(y) = 0                                   if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max

    with ``L_max = max_tokens`` and ``L_cache = buffer_tokens``. Source: Yu et al. 2025, "DAPO: An
    Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476), Sec. 3.4, eq. 13.
    R is continuous: -1 at exactly ``|y| = L_max`` (a completion cut off by the sampler's
    ``max_tokens`` = ``L_max`` gets the whole penalty).

    Args:
        completion_lens: ``[G]`` ints >= 0, tokens per completion.
        max_tokens: ``L_max`` >= 1, tokens.
        buffer_tokens: ``L_cache``, 1 <= ``buffer_tokens`` <= ``max_tokens``, tokens.

    Returns:
        ``[G] float64`` scores in [-1, 0].

    Raises:
        ValueError: a length is negative or not an integer, or the bounds above do not hold.
    """
    lens = np.asarray(completion_lens)
    if lens.dtype.kind not in "iu" or lens.ndim != 1:
        raise ValueError(f"completion_lens must be a 1-D integer array [G], got dtype {lens.dtype} shape {lens.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"completion_lens must be >= 0, got {int(lens.min())}")
    if not 1 <= buffer_tokens <= max_tokens:
        raise ValueError(
            f"overlong shaping needs 1 <= buffer_tokens <= max_tokens, got buffer_tokens={buffer_tokens}, max_tokens={max_tokens}"
        )
    expected = max_tokens - buffer_tokens
    lens = lens.astype(np.int64)
    score = np.minimum(0.0, (expected - lens) / buffer_tokens)
    score[lens > max_tokens] = -1.0
    return score


def overlong_zone_counts(completion_lens: np.ndarray, max_tokens: int, buffer_tokens: int) -> dict[str, int]:
    """``{"soft": samples inside the buffer (L_max - L_cache < |y| <= L_max), "hard": samples past
    L_max}`` for ``[G]`` integer lengths (what ``rlbus_rewards_overlong_total{zone}`` counts)."""
    lens = np.asarray(completion_lens, np.int64)
    hard = int((lens > max_tokens).sum())
    return {"soft": int((lens > max_tokens - buffer_tokens).sum()) - hard, "hard": hard}


def overlong_section(cfg: RunConfig) -> OverlongConfig | None:
    """The run's ``rewards.overlong`` with ``max_tokens`` resolved (``sampling.max_tokens`` when
    null), or None when the shaping is off."""
    section = cfg.rewards.overlong
    if section is None:
        return None
    return section.model_copy(update={"max_tokens": section.max_tokens or cfg.sampling.max_tokens})
