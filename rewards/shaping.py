"""DAPO's soft overlong punishment (``rewards.overlong``): a training sample's reward gets
``penalty * R(|y|)``, |y| its model tokens, as the term ``overlong`` (R in [-1, 0]), before the
advantages and the packer's group filters. Eval groups are not shaped. The same rule is verl's
``overlong_buffer``, TRL's ``get_soft_overlong_punishment`` and AReaL's/OpenRLHF's overlong penalty.
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
    """``[G] float64`` R in [-1, 0] of ``[G]`` int lengths (tokens): 0 up to ``L_max - L_cache``, then
    ``((L_max - L_cache) - |y|) / L_cache``, -1 past ``L_max`` (``L_max = max_tokens``, ``L_cache =
    buffer_tokens``). Source: DAPO (arXiv:2503.14476), Sec. 3.4, eq. 13. ValueError for a negative
    or non-integer length, or unless ``1 <= buffer_tokens <= max_tokens``."""
    lens = np.asarray(completion_lens)
    if lens.dtype.kind not in "iu" or lens.ndim != 1:
        raise ValueError(f"completion_lens must be a 1-D integer array [G], got dtype {lens.dtype} shape {lens.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"completion_lens must be >= 0, got {int(lens.min())}")
    if not 1 <= buffer_tokens <= max_tokens:
        raise ValueError(
            "overlong shaping needs 1 <= buffer_tokens <= max_tokens, "
            f"got buffer_tokens={buffer_tokens}, max_tokens={max_tokens}"
        )
    expected = max_tokens - buffer_tokens
    lens = lens.astype(np.int64)
    score = np.minimum(0.0, (expected - lens) / buffer_tokens)
    score[lens > max_tokens] = -1.0
    return score


def overlong_zone_counts(completion_lens: np.ndarray, max_tokens: int, buffer_tokens: int) -> dict[str, int]:
    """``{"soft": samples inside the buffer, "hard": samples past L_max}``."""
    lens = np.asarray(completion_lens, np.int64)
    hard = int((lens > max_tokens).sum())
    return {"soft": int((lens > max_tokens - buffer_tokens).sum()) - hard, "hard": hard}


def overlong_section(cfg: RunConfig) -> OverlongConfig | None:
    """``rewards.overlong`` with ``max_tokens`` resolved (default ``sampling.max_tokens``), or None."""
    section = cfg.rewards.overlong
    if section is None:
        return None
    return section.model_copy(update={"max_tokens": section.max_tokens or cfg.sampling.max_tokens})
