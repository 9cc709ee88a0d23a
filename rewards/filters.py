"""Sample filters on sampled tokens: flag degenerate completions (gibberish, repetition loops).

Both read the group's flat ``completion_ids`` and ``logprobs`` ``[N]`` (the sampling distribution's,
after temperature) split by ``completion_lens`` ``[G]``, vectorized with numpy. A flagged sample of
an ``enforce``-d filter is masked (trains nothing); its reward is kept, so the group's baseline does
not move (prime-rl's choice).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from configs.schema import FiltersConfig

FILTER_NAMES = ("gibberish", "repetition")


@dataclasses.dataclass(frozen=True)
class FilterResult:
    """``flags``: ``[G]`` comma-joined filter names (``[]``: no filter on); ``masked``: ``[G] bool``
    flagged by an enforced filter (``[0]``: none enforced); ``counts``: samples flagged per filter."""

    flags: list[str]
    masked: np.ndarray
    counts: dict[str, int]


def _sample_index(completion_lens: np.ndarray) -> np.ndarray:
    """``[N] int64``: each token's sample."""
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
    """``[G] bool``: a token with ``id > token_id_threshold`` and ``logprob < logprob_threshold`` (nats),
    rare and improbable. Source: Kimi K2 (arXiv:2510.02387), Sec. 5.2, as prime-rl's ``GibberishFilter``."""
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
    """``[G] bool``: ``window`` consecutive tokens of one sample each with ``exp(logprob) > prob_threshold``.
    Source: arXiv:2506.13585, Sec. 3.2, as prime-rl's ``RepetitionFilter``. ValueError for
    ``window < 1`` or ``prob_threshold`` outside (0, 1)."""
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
    """The filters enabled in ``cfg`` on one group."""
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
