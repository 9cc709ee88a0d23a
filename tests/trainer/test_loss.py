"""Tests for trainer.loss (AIPO-style token-level GRPO loss) against hand-computed values.

Shared example (2 packed samples, T = 7), with L = ln 2 = 0.6931471806:

    token           0      1      2      3      4      5      6
    sample          0      0      0      0      1      1      1
    loss_mask       F      T      T      T      F      T      T
    lp_train      -1.0   -0.5   -2.0  -0.25   -3.0   -1.5  -0.75
    log_ratio      0      0      L     4L      0     -2L    -8L
    ratio          1      1      2     16      1     1/4   1/256
    advantage     0.5    0.5    0.5    0.5   -1.0   -1.0   -1.0

- token 3: ratio 16 > token_mask_high 8 -> masked by the token bound.
- sample 0 geo mean = exp((0 + L + 4L) / 3) = 32^(1/3) = 3.1748 in [0.1, 10] -> kept.
- sample 1 geo mean = exp((-2L - 8L) / 2) = 2^-5 = 0.03125 < 0.1 -> whole sample masked,
  including token 5 whose own ratio 1/4 is inside [0.125, 8].
- keep = [F, T, T, F, F, F, F]; loss tokens = 5, masked loss tokens = 3 (tokens 3, 5, 6).
"""

import math

import numpy as np
import pytest
import torch

from trainer.loss import AipoLossConfig, aipo_loss, k3_kl, keep_mask, sample_ids

L2 = math.log(2.0)


def _example():
    lp_train = torch.tensor([-1.0, -0.5, -2.0, -0.25, -3.0, -1.5, -0.75], requires_grad=True)
    log_ratio = torch.tensor([0.0, 0.0, L2, 4 * L2, 0.0, -2 * L2, -8 * L2])
    lp_infer = lp_train.detach() - log_ratio
    advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -1.0, -1.0, -1.0])
    loss_mask = torch.tensor([False, True, True, True, False, True, True])
    seq_lens = torch.tensor([4, 3])
    return lp_train, lp_infer, advantages, loss_mask, seq_lens


def test_default_config_by_hand():
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    loss, stats = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, num_loss_tokens=10)
    # coeff_1 = ratio 1 * A 0.5 = 0.5 ; coeff_2 = ratio 2 * A 0.5 = 1.0
    # loss = -(0.5 * -0.5 + 1.0 * -2.0) / 10 = 2.25 / 10 = 0.225
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(0.225, rel=1e-6)
    loss.backward()
    # d loss / d lp_train = -coeff * keep / 10
    expected_grad = torch.tensor([0.0, -0.05, -0.1, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(lp_train.grad, expected_grad, rtol=1e-5, atol=1e-7)

    # k3 = r - 1 - ln r per loss token:
    #   t1: 0 ; t2: 1 - L = 0.3068528194 ; t3: 15 - 4L = 12.2274112778
    #   t5: -0.75 + 2L = 0.6362943611 ; t6: 1/256 - 1 + 8L = 4.5490836945  -> sum 17.7196421528
    assert stats["loss_tokens"] == 5
    assert stats["masked_tokens"] == 3
    assert stats["kl_sum"] == pytest.approx(17.7196421528, rel=1e-5)
    assert stats["ratio_sum"] == pytest.approx(1 + 2 + 16 + 0.25 + 0.00390625, rel=1e-5)
    assert stats["ratio_min"] == pytest.approx(0.00390625, rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(16.0, rel=1e-5)
    assert set(stats) == {"loss_tokens", "masked_tokens", "kl_sum", "ratio_sum", "ratio_min", "ratio_max"}
    assert all(isinstance(v, float) for v in stats.values())


def test_kl_tau_and_adv_tau_by_hand():
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    config = AipoLossConfig(adv_tau=2.0, kl_tau=0.1)
    loss, _ = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10, config)
    # coeff_1 = 1 * (2 * 0.5 - 0.1 * 0)   = 1.0
    # coeff_2 = 2 * (2 * 0.5 - 0.1 * L)   = 2 * 0.9306852819 = 1.8613705639
    # loss = -(1.0 * -0.5 + 1.8613705639 * -2.0) / 10 = (0.5 + 3.7227411278) / 10 = 0.4222741128
    assert loss.item() == pytest.approx(0.4222741128, rel=1e-6)
    loss.backward()
    expected_grad = torch.tensor([0.0, -0.1, -0.18613705639, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(lp_train.grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_tighter_geo_bound_masks_sample_zero_too():
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    # sample 0 geo mean 32^(1/3) = 3.1748: masked with high 3.0, kept with high 3.2
    loss, stats = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10, AipoLossConfig(geo_mask_high=3.0))
    assert loss.item() == 0.0
    assert stats["masked_tokens"] == 5
    loss.backward()
    assert lp_train.grad.tolist() == [0.0] * 7
    loss, stats = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10, AipoLossConfig(geo_mask_high=3.2))
    assert loss.item() == pytest.approx(0.225, rel=1e-6)
    assert stats["masked_tokens"] == 3


def test_wider_token_bound_keeps_token_three():
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    # token_mask_high 20 keeps token 3 (ratio 16): coeff_3 = 16 * 0.5 = 8
    # loss = -(0.5 * -0.5 + 1.0 * -2.0 + 8 * -0.25) / 10 = (0.25 + 2 + 2) / 10 = 0.425
    loss, stats = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10, AipoLossConfig(token_mask_high=20.0))
    assert loss.item() == pytest.approx(0.425, rel=1e-5)
    assert stats["masked_tokens"] == 2


def test_on_policy_reduces_to_token_mean_reinforce():
    # ratio = 1 everywhere: loss = -sum(A * lp * mask) / N
    lp_train = torch.tensor([0.0, -1.0, -2.0, 0.0, -4.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5])
    mask = torch.tensor([False, True, True, False, True])
    loss, stats = aipo_loss(lp_train, lp_train.detach().clone(), adv, mask, torch.tensor([3, 2]), 3)
    # -(1 * -1 + 1 * -2 + -0.5 * -4) / 3 = -(-1 - 2 + 2) / 3 = 1/3
    assert loss.item() == pytest.approx(1 / 3, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp_train.grad, torch.tensor([0.0, -1 / 3, -1 / 3, 0.0, 0.5 / 3]))
    assert stats == {
        "loss_tokens": 3.0,
        "masked_tokens": 0.0,
        "kl_sum": 0.0,
        "ratio_sum": 3.0,
        "ratio_min": 1.0,
        "ratio_max": 1.0,
    }


def test_micro_batch_losses_sum_to_step_mean():
    # Splitting the example into its two samples, each with num_loss_tokens = 10, sums to the whole.
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    whole, _ = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10)
    first, s1 = aipo_loss(lp_train[:4], lp_infer[:4], adv[:4], mask[:4], torch.tensor([4]), 10)
    second, s2 = aipo_loss(lp_train[4:], lp_infer[4:], adv[4:], mask[4:], torch.tensor([3]), 10)
    assert (first + second).item() == pytest.approx(whole.item(), rel=1e-6)
    assert s1["loss_tokens"] + s2["loss_tokens"] == 5
    assert s1["masked_tokens"] + s2["masked_tokens"] == 3


def test_no_loss_tokens_gives_zero_loss_and_identity_min_max():
    lp_train = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = aipo_loss(lp_train, lp_train.detach(), torch.ones(2), torch.zeros(2, dtype=torch.bool),
                            torch.tensor([2]), 4)
    assert loss.item() == 0.0
    loss.backward()
    assert lp_train.grad.tolist() == [0.0, 0.0]
    assert stats["loss_tokens"] == 0 and stats["ratio_sum"] == 0 and stats["kl_sum"] == 0
    assert stats["ratio_min"] == math.inf and stats["ratio_max"] == -math.inf


def test_extreme_ratios_give_finite_loss_and_zero_grad_there():
    # token 1 has log ratio 1000 (ratio overflows to inf), token 0 is a prompt token whose
    # lp_infer is -inf: neither may leak NaN into the loss or gradient.
    lp_train = torch.tensor([-1.0, -0.5, -1.0], requires_grad=True)
    lp_infer = torch.tensor([-math.inf, -1000.5, -1.0])
    mask = torch.tensor([False, True, True])
    cfg = AipoLossConfig(geo_mask_high=math.inf)
    loss, stats = aipo_loss(lp_train, lp_infer, torch.ones(3), mask, torch.tensor([3]), 2, cfg)
    # only token 2 kept: coeff 1 -> loss = -(1 * -1.0) / 2 = 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert lp_train.grad.tolist() == [0.0, 0.0, -0.5]
    assert stats["masked_tokens"] == 1


def test_k3_kl_by_hand():
    # k3(log r) = r - 1 - log r: log r = 0 -> 0 ; ln 2 -> 1 - ln 2 ; -ln 2 -> -0.5 + ln 2
    out = k3_kl(torch.tensor([0.0, L2, -L2], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([0.0, 1 - L2, -0.5 + L2], dtype=torch.float64))


def test_sample_ids_and_keep_mask_helpers():
    assert sample_ids(torch.tensor([2, 1, 3]), 6).tolist() == [0, 0, 1, 2, 2, 2]
    _, _, _, mask, seq_lens = _example()
    log_ratio = torch.tensor([0.0, 0.0, L2, 4 * L2, 0.0, -2 * L2, -8 * L2])
    keep = keep_mask(log_ratio, mask, sample_ids(seq_lens, 7), 2, AipoLossConfig())
    assert keep.tolist() == [False, True, True, False, False, False, False]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"adv_tau": -1.0}, "adv_tau"),
        ({"kl_tau": math.nan}, "kl_tau"),
        ({"token_mask_low": 1.5}, "token_mask_low"),
        ({"geo_mask_high": 0.5}, "geo_mask_low/geo_mask_high"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AipoLossConfig(**kwargs)


def test_bad_inputs_raise_value_error():
    lp_train, lp_infer, adv, mask, seq_lens = _example()
    with pytest.raises(ValueError, match="lp_infer must be a tensor of shape"):
        aipo_loss(lp_train, lp_infer[:5], adv, mask, seq_lens, 10)
    with pytest.raises(ValueError, match="seq_lens must sum"):
        aipo_loss(lp_train, lp_infer, adv, mask, torch.tensor([4, 2]), 10)
    with pytest.raises(ValueError, match="seq_lens must all be >= 1"):
        aipo_loss(lp_train, lp_infer, adv, mask, torch.tensor([7, 0]), 10)
    with pytest.raises(ValueError, match="loss_mask must be a bool"):
        aipo_loss(lp_train, lp_infer, adv, mask.int(), seq_lens, 10)
    with pytest.raises(ValueError, match="num_loss_tokens must be >= 1 and >= this micro-batch's 5"):
        aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 4)
    with pytest.raises(ValueError, match="num_loss_tokens must be an int"):
        aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, 10.0)
    loss, _ = aipo_loss(lp_train, lp_infer, adv, mask, seq_lens, np.int64(10))  # numpy int accepted
    assert loss.item() == pytest.approx(0.225, rel=1e-6)
    bad_adv = adv.clone()
    bad_adv[5] = math.nan
    with pytest.raises(ValueError, match="advantages must be finite on loss tokens.*token 5"):
        aipo_loss(lp_train, lp_infer, bad_adv, mask, seq_lens, 10)
    bad_infer = lp_infer.clone()
    bad_infer[0] = -math.inf  # not a loss token: accepted
    aipo_loss(lp_train, bad_infer, adv, mask, seq_lens, 10)
    bad_infer[1] = -math.inf
    with pytest.raises(ValueError, match="lp_infer must be finite on loss tokens.*token 1"):
        aipo_loss(lp_train, bad_infer, adv, mask, seq_lens, 10)
