"""Tests for the small pure functions of trainer.losses: KL estimators, sequence ratios, the TIS
weight, sample bookkeeping, masks and aggregation weights, against values computed by hand."""

import math

import pytest
import torch

from trainer.losses import (
    LossSpec,
    StepNorm,
    aggregation_weights,
    geo_mean_mask,
    icepop_mask,
    keep_mask,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    loss_counts,
    mismatch_kl,
    ratio_in_bounds,
    sample_ids,
    sequence_extreme_mask,
    sequence_mean_log_ratio,
    sequence_sum_log_ratio,
    tis_weight,
)

torch.set_num_threads(1)
F64 = torch.float64
L2 = math.log(2.0)


def test_kl_estimators_by_hand():
    # log r in {0, ln 2, -ln 2}:
    #   k1 = -log r        -> 0, -ln 2, ln 2
    #   k2 = (log r)^2 / 2 -> 0, (ln 2)^2 / 2, (ln 2)^2 / 2
    #   k3 = r - 1 - log r -> 0, 1 - ln 2, -0.5 + ln 2
    log_r = torch.tensor([0.0, L2, -L2], dtype=F64)
    torch.testing.assert_close(kl_k1(log_r), torch.tensor([0.0, -L2, L2], dtype=F64))
    torch.testing.assert_close(kl_k2(log_r), torch.tensor([0.0, L2**2 / 2, L2**2 / 2], dtype=F64))
    torch.testing.assert_close(kl_k3(log_r), torch.tensor([0.0, 1 - L2, -0.5 + L2], dtype=F64))
    torch.testing.assert_close(mismatch_kl(log_r), kl_k3(log_r))


def test_k1_and_k3_are_unbiased_and_k2_is_close():
    # Exact expectations over a 3-outcome distribution (no sampling): x ~ q, r = p(x) / q(x).
    # KL(q || p) = sum q log(q / p) = 0.5 ln(0.5/0.2) + 0.3 ln(1) + 0.2 ln(0.2/0.5) = 0.3 ln 2.5
    q = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    p = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    log_r = torch.log(p) - torch.log(q)
    kl = 0.3 * math.log(2.5)
    assert float((q * kl_k1(log_r)).sum()) == pytest.approx(kl, rel=1e-12)
    assert float((q * kl_k3(log_r)).sum()) == pytest.approx(kl, rel=1e-12)
    # k2's expectation 0.5 (0.5 ln^2 2.5 + 0.2 ln^2 2.5) = 0.35 ln^2 2.5 (biased, close for close p, q)
    assert float((q * kl_k2(log_r)).sum()) == pytest.approx(0.35 * math.log(2.5) ** 2, rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_values_and_gradients(estimator):
    # x = train_logprobs - ref_logprobs = [ln 2, -ln 2, 0]:
    #   k1 = x                  d/d train_logprobs = 1
    #   k2 = x^2 / 2            d/d train_logprobs = x
    #   k3 = e^-x - 1 + x       d/d train_logprobs = 1 - e^-x   -> at ln 2: 0.5 ; at -ln 2: -1 ; at 0: 0
    train_logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=F64, requires_grad=True)
    x = [L2, -L2, 0.0]
    ref_logprobs = train_logprobs.detach() - torch.tensor(x, dtype=F64)
    value = kl_penalty(train_logprobs, ref_logprobs, estimator)
    value.sum().backward()
    expected = {
        "k1": ([L2, -L2, 0.0], [1.0, 1.0, 1.0]),
        "k2": ([L2**2 / 2, L2**2 / 2, 0.0], [L2, -L2, 0.0]),
        "k3": ([0.5 - 1 + L2, 2 - 1 - L2, 0.0], [0.5, -1.0, 0.0]),
    }[estimator]
    torch.testing.assert_close(value.detach(), torch.tensor(expected[0], dtype=F64))
    torch.testing.assert_close(train_logprobs.grad, torch.tensor(expected[1], dtype=F64))


def test_kl_penalty_k3_clamps_extreme_log_ratios():
    # x = -100: e^100 would be 2.7e43; the log ratio is clamped to 20 -> k3 = e^20 - 1 - 20, no gradient
    train_logprobs = torch.tensor([-101.0], dtype=F64, requires_grad=True)
    value = kl_penalty(train_logprobs, torch.tensor([-1.0], dtype=F64), "k3")
    value.backward()
    assert value.item() == pytest.approx(math.exp(20) - 21, rel=1e-12)
    assert train_logprobs.grad.item() == 0.0
    with pytest.raises(ValueError, match="kl estimator must be one of k1, k2, k3"):
        kl_penalty(train_logprobs, train_logprobs.detach(), "k4")


def test_sequence_ratios_by_hand():
    # seq_lens [2, 3], mask [F, T, T, T, F], log r [9, ln 2, ln 2, -ln 2, 9]:
    #   sample 0: loss tokens {1}: sum ln 2, mean ln 2 ; sample 1: {2, 3}: sum 0, mean 0
    #   (the 9s are prompt tokens and must not count)
    log_r = torch.tensor([9.0, L2, L2, -L2, 9.0], dtype=F64)
    mask = torch.tensor([False, True, True, True, False])
    ids = sample_ids(torch.tensor([2, 3]), 5)
    torch.testing.assert_close(sequence_sum_log_ratio(log_r, mask, ids, 2), torch.tensor([L2, 0.0], dtype=F64))
    torch.testing.assert_close(sequence_mean_log_ratio(log_r, mask, ids, 2), torch.tensor([L2, 0.0], dtype=F64))
    # geometric mean of ratios 2, 8 (sample of two tokens) = 4 ; product = 16
    log_r2 = torch.tensor([L2, 3 * L2], dtype=F64)
    both = torch.tensor([True, True])
    one = sample_ids(torch.tensor([2]), 2)
    assert math.exp(float(sequence_mean_log_ratio(log_r2, both, one, 1))) == pytest.approx(4.0)
    assert math.exp(float(sequence_sum_log_ratio(log_r2, both, one, 1))) == pytest.approx(16.0)
    # a sample with no mask token: sum 0, mean 0 (ratio 1)
    assert sequence_mean_log_ratio(log_r2, torch.tensor([False, False]), one, 1).tolist() == [0.0]


def test_tis_weight_by_hand():
    # pi_old / pi_rollout = 0.25, 1, 4 -> clip to [0.5, 2] -> 0.5, 1, 2
    old_logprobs = torch.tensor([-2 * L2, -1.0, 2 * L2], dtype=F64)
    sampler_logprobs = torch.tensor([0.0, -1.0, 0.0], dtype=F64)
    torch.testing.assert_close(
        tis_weight(old_logprobs, sampler_logprobs, 0.5, 2.0), torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    )


def test_sample_ids_and_loss_counts():
    assert sample_ids(torch.tensor([2, 1, 3]), 6).tolist() == [0, 0, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="seq_lens must sum"):
        sample_ids(torch.tensor([2, 1]), 6)
    with pytest.raises(ValueError, match="integer tensor"):
        sample_ids(torch.tensor([2.0, 4.0]), 6)
    # 3 samples, the middle one with no loss token
    assert loss_counts(torch.tensor([False, True, False, False, True, True]), torch.tensor([2, 1, 3])) == (3, 2)


def test_masks_by_hand():
    # ratios per token: sample 0 (tokens 0-2): 1, 2, 16 ; sample 1 (tokens 3-4): 1/4, 1/256
    log_r = torch.tensor([0.0, L2, 4 * L2, -2 * L2, -8 * L2], dtype=F64)
    mask = torch.tensor([False, True, True, True, True])
    ids = sample_ids(torch.tensor([3, 2]), 5)
    # bounds inclusive
    assert ratio_in_bounds(log_r, 0.25, 2.0).tolist() == [True, True, False, True, False]
    assert ratio_in_bounds(torch.tensor([math.nan]), 0.0, math.inf).tolist() == [False]
    # geo means over loss tokens: sample 0: (2 * 16)^(1/2) = 5.66 ; sample 1: (1/1024)^(1/2) = 1/32
    assert geo_mean_mask(log_r, mask, ids, 2, 0.1, 10.0).tolist() == [True, True, True, False, False]
    assert geo_mean_mask(log_r, mask, ids, 2, 0.01, 5.0).tolist() == [False, False, False, True, True]
    # extreme tokens: sample 0 has max 16 (token 0 is not a loss token), sample 1 min 1/256
    assert sequence_extreme_mask(log_r, mask, ids, 2, None, 10.0).tolist() == [False, False, False, True, True]
    assert sequence_extreme_mask(log_r, mask, ids, 2, 0.01, None).tolist() == [True, True, True, False, False]
    assert sequence_extreme_mask(log_r, mask, ids, 2, None, None).all()
    # IcePop beta 4: [0.25, 4]
    assert icepop_mask(log_r, 4.0).tolist() == [True, True, False, True, False]


def test_keep_mask_combines_masks_per_type():
    log_r = torch.tensor([0.0, L2, 4 * L2, -2 * L2, -8 * L2], dtype=F64)
    mask = torch.tensor([False, True, True, True, True])
    ids = sample_ids(torch.tensor([3, 2]), 5)
    # aipo defaults: token mask [1/8, 8] drops tokens 2 (16) and 4 (1/256); geo mask [0.1, 10] drops sample 1 (1/32)
    assert keep_mask(log_r, mask, ids, 2, LossSpec()).tolist() == [False, True, False, False, False]
    # ppo_clip ignores the aipo masks; IcePop beta 4 drops tokens 2 and 4
    assert keep_mask(log_r, mask, ids, 2, LossSpec(type="ppo_clip")).tolist() == [False, True, True, True, True]
    assert keep_mask(log_r, mask, ids, 2, LossSpec(type="ppo_clip", icepop_beta=4.0)).tolist() == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_aggregation_weights_by_hand():
    # seq_lens [3, 2, 2]; loss tokens: sample 0 {1, 2} (n 2), sample 1 none (zero-length), sample 2 {5, 6} (n 2)
    mask = torch.tensor([False, True, True, False, False, True, True])
    ids = sample_ids(torch.tensor([3, 2, 2]), 7)
    norm = StepNorm(loss_tokens=8, num_samples=5, max_tokens=4)
    w = aggregation_weights(mask, ids, 3, norm, "token_mean")
    torch.testing.assert_close(w, torch.tensor([0, 1 / 8, 1 / 8, 0, 0, 1 / 8, 1 / 8], dtype=F64))
    w = aggregation_weights(mask, ids, 3, norm, "seq_mean_token_mean")  # 1 / (n_i G) = 1 / 10
    torch.testing.assert_close(w, torch.tensor([0, 0.1, 0.1, 0, 0, 0.1, 0.1], dtype=F64))
    w = aggregation_weights(mask, ids, 3, norm, "seq_mean_token_sum_norm")  # 1 / (L G) = 1 / 20
    torch.testing.assert_close(w, torch.tensor([0, 0.05, 0.05, 0, 0, 0.05, 0.05], dtype=F64))
    # a step with no loss token: all-zero weights, no division by zero
    empty = torch.zeros(7, dtype=torch.bool)
    assert aggregation_weights(empty, ids, 3, StepNorm(0, 0, 4), "seq_mean_token_mean").tolist() == [0.0] * 7
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregation_weights(mask, ids, 3, norm, "sum")
