"""Sample filters on sampled tokens: flag degenerate completions (gibberish, repetition loops).

A reward worker runs the enabled filters on every group (``filters`` in the run config). A flagged
sample is counted in ``rlbus_rewards_filtered_total{filter}``; when the filter is ``enforce``-d it is
also *masked*: the packer clears its loss mask, so it trains nothing. Its reward is kept, so the
group's baseline (the advantage's mean) does not move (prime-rl's and Surogate's choice).

Both filters read the sampler's own record of each token: ``completion_ids`` and ``logprobs``, the
group's flat ``[N]`` arrays with ``completion_lens`` ``[G]`` splitting them (see
:class:`bus.messages.RolloutGroup`). The logprobs are those of the sampling distribution (after
temperature), so the thresholds apply to what was actually sampled. Both are vectorized over the
whole group with numpy: no Python loop over tokens.

- **gibberish** (Kimi K2's / prime-rl's gibberish filter, arXiv:2510.02387 Sec. 5.2): a sample is
  flagged when one of its tokens is both rare (``id > token_id_threshold``: BPE vocabularies put
  rare merges last) and improbable (``logprob < logprob_threshold``): rare pieces drawn at high
  entropy, the signature of a collapsing generation.
- **repetition** (prime-rl's repetition filter, arXiv:2506.13585 Sec. 3.2): a sample is flagged
  when it has a run of ``window`` consecutive tokens, each sampled with probability
  ``exp(logprob) > prob_threshold``: a model locked in a loop emits it with near certainty.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from configs.schema import FiltersConfig

FILTER_NAMES = ("gibberish", "repetition")


@dataclasses.dataclass(frozen=True)
class FilterResult:
    """What the filters found in one group of G samples.

    Fields:
        flags: ``[G]`` comma-joined names of the filters that flagged each sample (``""``: none),
            or ``[]`` when no filter is enabled.
        masked: ``[G] bool``, True where an enforced filter flagged the sample, or ``[0]`` when
            no enabled filter is enforced.
        counts: ``{filter name: samples it flagged}`` for each enabled filter.
    """

    flags: list[str]
    masked: np.ndarray
    counts: dict[str, int]


def _sample_index(completion_lens: np.ndarray) -> np.ndarray:
    """``[N] int64``: the sample each token belongs to (``N = sum(completion_lens)``)."""
    lens = np.asarray(completion_lens, np.int64)
    return np.repeat(np.arange(len(lens)), lens)


def gibberish_flags(
    completion_ids: np.ndarray,
    logprobs: np.ndarray,
    completion_lens: np.ndarray,
    *,
    token_id_threshold: int,
    logprob_threshold: float,
) -> np.ndarray:
    """``[G] bool``: sample ``j`` has a token with ``id > token_id_threshold`` and
    ``logprob < logprob_threshold`` (nats). Inputs: ``[N] int``, ``[N] float``, ``[G] int``.
    Source: arXiv:2510.02387 Sec. 5.2 (as in prime-rl's ``GibberishFilter``)."""
    flagged = np.zeros(len(completion_lens), bool)
    bad = (np.asarray(completion_ids) > token_id_threshold) & (np.asarray(logprobs) < logprob_threshold)
    flagged[_sample_index(completion_lens)[bad]] = True
    return flagged


def repetition_flags(
    logprobs: np.ndarray,
    completion_lens: np.ndarray,
    *,
    window: int,
    prob_threshold: float,
) -> np.ndarray:
    """``[G] bool``: sample ``j`` has ``window`` consecutive tokens, each with
    ``exp(logprob) > prob_threshold`` (equivalently ``logprob > log(prob_threshold)``).
    Inputs: ``[N] float``, ``[G] int``. Source: arXiv:2506.13585 Sec. 3.2 (as in prime-rl's
    ``RepetitionFilter``).

    Every window of ``window`` tokens is tested at once: with ``c`` the cumulative count of
    confident tokens, window ``[s, s + window)`` is all confident iff ``c[s + window] - c[s] == window``,
    and it must not straddle two samples.

    Raises:
        ValueError: ``window < 1`` or ``prob_threshold`` not in (0, 1).
    """
    if window < 1 or not 0 < prob_threshold < 1:
        raise ValueError(
            f"repetition filter needs window >= 1 and 0 < prob_threshold < 1, got {window}, {prob_threshold}"
        )
    flagged = np.zeros(len(completion_lens), bool)
    n = len(logprobs)
    if n < window:
        return flagged
    confident = np.asarray(logprobs, np.float64) > math.log(prob_threshold)
    counts = np.concatenate([[0], np.cumsum(confident, dtype=np.int64)])
    starts = np.arange(n - window + 1)
    sample = _sample_index(completion_lens)
    hit = (counts[starts + window] - counts[starts] == window) & (sample[starts] == sample[starts + window - 1])
    flagged[sample[starts[hit]]] = True
    return flagged


def apply_filters(
    cfg: FiltersConfig, completion_ids: np.ndarray, logprobs: np.ndarray, completion_lens: np.ndarray
) -> FilterResult:
    """Run the filters enabled in ``cfg`` on one group (arrays as in :func:`gibberish_flags`)."""
    found: dict[str, np.ndarray] = {}
    enforced: list[str] = []
    if cfg.gibberish.enabled:
        found["gibberish"] = gibberish_flags(
            completion_ids,
            logprobs,
            completion_lens,
            token_id_threshold=cfg.gibberish.token_id_threshold,
            logprob_threshold=cfg.gibberish.logprob_threshold,
        )
        if cfg.gibberish.enforce:
            enforced.append("gibberish")
    if cfg.repetition.enabled:
        found["repetition"] = repetition_flags(
            logprobs, completion_lens, window=cfg.repetition.window, prob_threshold=cfg.repetition.prob_threshold
        )
        if cfg.repetition.enforce:
            enforced.append("repetition")
    g = len(completion_lens)
    flags = [",".join(name for name, hit in found.items() if hit[j]) for j in range(g)] if found else []
    masked = np.zeros(g, bool) if enforced else np.zeros(0, bool)
    for name in enforced:
        masked |= found[name]
    return FilterResult(flags, masked, {name: int(hit.sum()) for name, hit in found.items()})
