"""Tests for bus.sample_arrays: run-length policy version spans of a group and per-token versions
of a micro-batch, through the real codec (encode -> decode validates every span)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bus.codec import decode, encode
from bus.sample_arrays import pack_spans, run_lengths, sample_token_versions
from bus.wire import WireError


def test_run_lengths_merge_equal_neighbours():
    np.testing.assert_array_equal(run_lengths([4, 4, 5, 5, 5, 4]), [[4, 2], [5, 3], [4, 1]])
    assert run_lengths([]).shape == (0, 2)
    spans, counts = pack_spans([run_lengths([1, 2]), run_lengths([]), run_lengths([2, 3, 3])])
    np.testing.assert_array_equal(spans, [[1, 1], [2, 1], [2, 1], [3, 2]])
    assert counts.tolist() == [2, 0, 2] and counts.dtype == np.int32 and spans.dtype == np.int64


def test_spans_round_trip_and_expand_per_sample(example):
    group = decode(encode(example("rollout")))
    assert [sample_token_versions(group, j).tolist() for j in range(3)] == [[1, 2], [], [2, 3, 3]]
    scored = decode(encode(example("scored")))
    np.testing.assert_array_equal(scored.version_spans, group.version_spans)


def test_group_without_spans_counts_every_token_at_version_start(example):
    group = dataclasses.replace(
        example("rollout"), version_spans=np.zeros((0, 2), np.int64), version_span_counts=np.zeros(0, np.int32)
    )
    group = decode(encode(group))
    assert [sample_token_versions(group, j).tolist() for j in range(3)] == [[1, 1], [], [2, 2, 2]]


def test_a_rolled_back_policy_may_make_later_tokens_older(example):
    """After a resumed trainer rolls the policy back, an in-flight sample's later tokens are older."""
    group = dataclasses.replace(example("rollout"), version_spans=np.array([[2, 1], [1, 1], [3, 2], [2, 1]], np.int64))
    assert sample_token_versions(decode(encode(group)), 2).tolist() == [3, 3, 2]


@pytest.mark.parametrize(
    "spans, counts",
    [
        ([[1, 1], [2, 1], [2, 1], [3, 1]], [2, 0, 2]),  # sample 2 covers 2 of its 3 tokens
        ([[1, 2], [2, 1], [3, 2]], [1, 0, 2]),  # sample 0's max (1) is not its version_end (2)
        ([[1, 1], [2, 1], [2, 1], [3, 2], [3, 0]], [2, 0, 3]),  # an empty span
        ([[1, 1], [2, 1], [-1, 1], [3, 2]], [2, 0, 2]),  # a negative version
        ([[1, 1], [2, 1], [2, 1], [3, 2]], [2, 2]),  # one count per sample
        ([[1, 1], [2, 1], [2, 1], [3, 2]], [2, 1, 2]),  # counts that do not sum to the spans
        ([[1, 1], [2, 1], [2, 1], [3, 2]], []),  # spans without counts
    ],
    ids=["uncovered", "max_not_end", "empty_span", "negative", "counts_len", "counts_sum", "no_counts"],
)
def test_inconsistent_spans_are_rejected(example, spans, counts):
    bad = dataclasses.replace(
        example("rollout"),
        version_spans=np.array(spans, np.int64).reshape(-1, 2),
        version_span_counts=np.array(counts, np.int32),
    )
    with pytest.raises(WireError) as err:
        decode(encode(bad))
    assert err.value.reason == "inconsistent"


def test_micro_batch_token_versions_must_match_the_oldest_versions(example):
    mb = decode(encode(example("micro_batch")))
    assert mb.token_versions.tolist() == [3, 3, 3, 4, 4, 4, 5]
    for bad in ([3, 3, 3, 4, 4, 4], [4, 3, 4, 5, 5, 5, 5], [3, 3, 3, 4, 4, -4, 5], [2, 3, 3, 4, 4, 4, 5]):
        with pytest.raises(WireError) as err:
            decode(encode(dataclasses.replace(mb, token_versions=np.array(bad, np.int64))))
        assert err.value.reason == "inconsistent"
