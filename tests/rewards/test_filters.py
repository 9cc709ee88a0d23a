"""Tests for rewards.filters: gibberish and repetition flags on a group's flat token arrays, against
hand-built cases and a per-token loop (the definition, as prime-rl writes it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from configs.schema import FiltersConfig
from rewards.filters import apply_filters, gibberish_flags, repetition_flags

SURE = -0.01  # exp(-0.01) = 0.990: above a 0.9 threshold
UNSURE = -2.0  # exp(-2) = 0.135


def flat(samples: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``[N] float32`` values and ``[G] int32`` lens of per-sample lists."""
    values = np.array([v for s in samples for v in s], np.float32)
    return values, np.array([len(s) for s in samples], np.int32)


def test_gibberish_needs_a_token_both_rare_and_improbable():
    # thresholds: id > 100 and logprob < -5
    ids = np.array([5, 200, 7, 300, 1, 101, 100], np.int32)
    logprobs = np.array([-9, -6, -1, -1, -10, -5, -7], np.float32)
    lens = np.array([3, 2, 0, 1, 1], np.int32)
    got = gibberish_flags(ids, logprobs, lens, token_id_threshold=100, logprob_threshold=-5.0)
    # sample 0: id 200 at -6 -> flagged; 1: 300 is probable, -10 is a common id; 2: empty;
    # 3: logprob -5 is not below -5 (strict); 4: id 100 is not above 100 (strict)
    assert got.tolist() == [True, False, False, False, False]


def test_repetition_runs_do_not_straddle_samples():
    s, u = SURE, UNSURE
    logprobs, lens = flat(
        [
            [s, s, u, s, s],  # runs of 2 only
            [s, u, s, s],  # its first token + the previous sample's last two would make 3: not one sample
            [u, s, s, s],  # a run of 3
            [s, s, s],  # exactly the window
            [],
            [s, s],  # shorter than the window
        ]
    )
    got = repetition_flags(logprobs, lens, window=3, prob_threshold=0.9)
    assert got.tolist() == [False, False, True, True, False, False]


def test_repetition_threshold_is_on_probability():
    # p = 0.95 each: flagged at prob_threshold 0.9, not at 0.97
    logprobs, lens = flat([[math.log(0.95)] * 4])
    assert repetition_flags(logprobs, lens, window=4, prob_threshold=0.9).tolist() == [True]
    assert repetition_flags(logprobs, lens, window=4, prob_threshold=0.97).tolist() == [False]
    assert repetition_flags(logprobs, lens, window=5, prob_threshold=0.9).tolist() == [False]


def loop_flags(ids, logprobs, lens, *, token_id_threshold, logprob_threshold, window, prob_threshold):
    """The definitions token by token (prime-rl's GibberishFilter/RepetitionFilter loops)."""
    gib, rep, start = [], [], 0
    for n in lens:
        streak, g, r = 0, False, False
        for t in range(start, start + n):
            g |= bool(ids[t] > token_id_threshold and logprobs[t] < logprob_threshold)
            streak = streak + 1 if math.exp(logprobs[t]) > prob_threshold else 0
            r |= streak >= window
        gib.append(g)
        rep.append(r)
        start += n
    return gib, rep


@pytest.mark.parametrize("seed", range(5))
def test_vectorized_filters_match_the_token_loop(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 40, size=64).astype(np.int32)
    n = int(lens.sum())
    ids = rng.integers(0, 1000, size=n).astype(np.int32)
    # mostly near-certain tokens, so runs of every length occur
    logprobs = np.where(rng.random(n) < 0.85, SURE, rng.uniform(-15, 0, size=n)).astype(np.float32)
    params = dict(token_id_threshold=900, logprob_threshold=-10.0)
    gib, rep = loop_flags(ids, logprobs, lens, window=6, prob_threshold=0.9, **params)
    got_gib = gibberish_flags(ids, logprobs, lens, **params)
    got_rep = repetition_flags(logprobs, lens, window=6, prob_threshold=0.9)
    assert got_gib.tolist() == gib and got_rep.tolist() == rep
    assert 0 < sum(rep) < len(lens) and 0 < sum(gib) < len(lens)  # the case exercises both outcomes


def test_apply_filters_flags_masks_and_counts():
    s, u = SURE, UNSURE
    logprobs, lens = flat([[s, s, s], [u, -20.0], [s, s, -20.0], [u]])
    ids = np.array([1, 2, 3, 4, 500, 1, 2, 600, 9], np.int32)
    cfg = FiltersConfig.model_validate(
        {
            "gibberish": {"enabled": True, "enforce": False, "token_id_threshold": 100, "logprob_threshold": -12.0},
            "repetition": {"enabled": True, "enforce": True, "window": 3, "prob_threshold": 0.9},
        }
    )
    got = apply_filters(cfg, ids, logprobs, lens)
    assert got.flags == ["repetition", "gibberish", "gibberish", ""]
    assert got.masked.tolist() == [True, False, False, False]  # only the enforced filter masks
    assert got.counts == {"gibberish": 2, "repetition": 1}
    # both found in one sample: both named
    both = apply_filters(cfg, np.array([1, 2, 3, 700], np.int32), *flat([[s, s, s, -20.0]]))
    assert both.flags == ["gibberish,repetition"] and both.masked.tolist() == [True]


def test_no_filter_enabled_gives_empty_flags_and_mask():
    logprobs, lens = flat([[SURE] * 300])
    got = apply_filters(FiltersConfig(), np.full(300, 200_000, np.int32), logprobs, lens)
    assert got.flags == [] and got.masked.shape == (0,) and got.counts == {}
    # enabled but not enforced: flagged, nothing masked
    cfg = FiltersConfig.model_validate({"repetition": {"enabled": True}})
    got = apply_filters(cfg, np.zeros(300, np.int32), logprobs, lens)
    assert got.flags == ["repetition"] and got.masked.shape == (0,) and got.counts == {"repetition": 1}


def test_bad_repetition_parameters():
    logprobs, lens = flat([[SURE]])
    with pytest.raises(ValueError, match="window"):
        repetition_flags(logprobs, lens, window=0, prob_threshold=0.9)
    with pytest.raises(ValueError, match="prob_threshold"):
        repetition_flags(logprobs, lens, window=2, prob_threshold=1.0)
