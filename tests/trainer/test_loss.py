"""Tests for trainer.loss.policy_loss with the default loss (aipo), its masks, input checks, edge
cases, against values computed by hand in float64.

Shared example (2 packed samples, T = 7), with L = ln 2 = 0.6931471806:

    token           0      1      2      3      4      5      6
    sample          0      0      0      0      1      1      1
    loss_mask       F      T      T      T      F      T      T
    train_logprobs      -1.0   -0.5   -2.0  -0.25   -3.0   -1.5  -0.75
    log_ratio      0      0      L     4L      0     -2L    -8L      (train_logprobs - sampler_logprobs)
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

from trainer.losses import LossBatch, LossSpec, StepNorm, loss_counts, policy_loss

torch.set_num_threads(1)
L2 = math.log(2.0)
F64 = torch.float64


def _example(**extra):
    train_logprobs = torch.tensor([-1.0, -0.5, -2.0, -0.25, -3.0, -1.5, -0.75], dtype=F64, requires_grad=True)
    log_ratio = torch.tensor([0.0, 0.0, L2, 4 * L2, 0.0, -2 * L2, -8 * L2], dtype=F64)
    return LossBatch(
        train_logprobs=train_logprobs,
        sampler_logprobs=train_logprobs.detach() - log_ratio,
        advantages=torch.tensor([0.5, 0.5, 0.5, 0.5, -1.0, -1.0, -1.0], dtype=F64),
        loss_mask=torch.tensor([False, True, True, True, False, True, True]),
        seq_lens=torch.tensor([4, 3]),
        **extra,
    )


NORM = StepNorm(loss_tokens=10, num_samples=4, max_tokens=8)  # a step larger than this micro-batch


def test_default_aipo_by_hand():
    batch = _example()
    loss, stats = policy_loss(batch, NORM, LossSpec())
    # coeff_t = ratio_t * A_t on kept tokens: coeff_1 = 1 * 0.5 = 0.5 ; coeff_2 = 2 * 0.5 = 1.0
    # loss = -(0.5 * -0.5 + 1.0 * -2.0) / 10 = 2.25 / 10 = 0.225
    assert loss.ndim == 0 and loss.dtype == F64
    assert loss.item() == pytest.approx(0.225, rel=1e-12)
    loss.backward()
    # d loss / d train_logprobs = -coeff * keep / 10
    torch.testing.assert_close(
        batch.train_logprobs.grad, torch.tensor([0.0, -0.05, -0.1, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    )
    # k3 = r - 1 - ln r per loss token:
    #   t1: 0 ; t2: 1 - L = 0.3068528194 ; t3: 15 - 4L = 12.2274112778
    #   t5: -0.75 + 2L = 0.6362943611 ; t6: 1/256 - 1 + 8L = 4.5490836945  -> sum 17.7196421528
    assert stats == pytest.approx(
        {
            "loss_tokens": 5,
            "masked_tokens": 3,
            "clipped_tokens": 0,
            "kl_sum": 17.7196421528,
            "ratio_sum": 1 + 2 + 16 + 0.25 + 0.00390625,
            "ratio_min": 0.00390625,
            "ratio_max": 16.0,
        },
        rel=1e-9,
    )
    assert all(isinstance(v, float) for v in stats.values())


def test_geo_bound_masks_sample_zero_too():
    # sample 0 geo mean 32^(1/3) = 3.1748: masked with high 3.0, kept with high 3.2
    batch = _example()
    loss, stats = policy_loss(batch, NORM, LossSpec(geo_mask_high=3.0))
    assert loss.item() == 0.0 and stats["masked_tokens"] == 5
    loss.backward()
    assert batch.train_logprobs.grad.tolist() == [0.0] * 7
    loss, stats = policy_loss(_example(), NORM, LossSpec(geo_mask_high=3.2))
    assert loss.item() == pytest.approx(0.225, rel=1e-12) and stats["masked_tokens"] == 3


def test_wider_token_bound_keeps_token_three():
    # token_mask_high 20 keeps token 3 (ratio 16): coeff_3 = 16 * 0.5 = 8
    # loss = -(0.5 * -0.5 + 1.0 * -2.0 + 8 * -0.25) / 10 = (0.25 + 2 + 2) / 10 = 0.425
    loss, stats = policy_loss(_example(), NORM, LossSpec(token_mask_high=20.0))
    assert loss.item() == pytest.approx(0.425, rel=1e-12)
    assert stats["masked_tokens"] == 2


def test_sequence_masks_by_hand():
    # sample 0 token ratios (loss tokens) 1, 2, 16 -> min 1, max 16 ; sample 1: 1/4, 1/256.
    # Open the token and geo masks so only the sequence masks act.
    wide = dict(token_mask_low=0.0, token_mask_high=1e6, geo_mask_low=0.0, geo_mask_high=1e6)
    # sequence_mask_high 10: sample 0 (max 16) masked whole; sample 1 kept:
    #   coeff_5 = 1/4 * -1 = -0.25, coeff_6 = 1/256 * -1 ; loss = -(-0.25 * -1.5 + -1/256 * -0.75) / 10
    loss, stats = policy_loss(_example(), NORM, LossSpec(sequence_mask_high=10.0, **wide))
    assert loss.item() == pytest.approx(-(0.375 + 0.75 / 256) / 10, rel=1e-12)
    assert stats["masked_tokens"] == 3
    # sequence_mask_low 0.1: sample 1 (min 1/256) masked whole; sample 0 kept (coeff 0.5, 1.0, 8.0):
    #   loss = -(0.5 * -0.5 + 1.0 * -2.0 + 8.0 * -0.25) / 10 = 0.425
    batch = _example()
    loss, stats = policy_loss(batch, NORM, LossSpec(sequence_mask_low=0.1, **wide))
    assert loss.item() == pytest.approx(0.425, rel=1e-12)
    assert stats["masked_tokens"] == 2
    loss.backward()
    torch.testing.assert_close(batch.train_logprobs.grad, torch.tensor([0, -0.05, -0.1, -0.8, 0, 0, 0], dtype=F64))


def test_sequence_ratio_type_by_hand():
    # ratio_type sequence: every kept token of sample i is weighted by prod_t r_t over ITS loss
    # tokens, clipped above at sequence_clip_high (prime-rl). Open the masks.
    wide = dict(token_mask_low=0.0, token_mask_high=1e6, geo_mask_low=0.0, geo_mask_high=1e6)
    # sample 0: 1 * 2 * 16 = 32 -> clipped to 10 ; sample 1: 1/4 * 1/256 = 1/1024 (not clipped)
    # coeff: sample 0 tokens 10 * 0.5 = 5 ; sample 1 tokens -1/1024
    # loss = -(5 * (-0.5 - 2.0 - 0.25) + (-1/1024) * (-1.5 - 0.75)) / 10 = (13.75 - 2.25/1024) / 10
    batch = _example()
    loss, stats = policy_loss(batch, NORM, LossSpec(ratio_type="sequence", **wide))
    assert loss.item() == pytest.approx((13.75 - 2.25 / 1024) / 10, rel=1e-12)
    assert stats["clipped_tokens"] == 3  # sample 0's three loss tokens: its ratio hit the clip
    loss.backward()
    torch.testing.assert_close(
        batch.train_logprobs.grad, torch.tensor([0, -0.5, -0.5, -0.5, 0, 1 / 10240, 1 / 10240], dtype=F64)
    )


def test_on_policy_reduces_to_token_mean_reinforce():
    # ratio = 1 everywhere: loss = -sum(A * lp * mask) / N
    train_logprobs = torch.tensor([0.0, -1.0, -2.0, 0.0, -4.0], dtype=F64, requires_grad=True)
    batch = LossBatch(
        train_logprobs,
        train_logprobs.detach().clone(),
        torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5], dtype=F64),
        torch.tensor([False, True, True, False, True]),
        torch.tensor([3, 2]),
    )
    loss, stats = policy_loss(batch, StepNorm(3, 2, 4), LossSpec())
    # -(1 * -1 + 1 * -2 + -0.5 * -4) / 3 = -(-1 - 2 + 2) / 3 = 1/3
    assert loss.item() == pytest.approx(1 / 3, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(train_logprobs.grad, torch.tensor([0.0, -1 / 3, -1 / 3, 0.0, 0.5 / 3], dtype=F64))
    assert stats["kl_sum"] == 0.0 and stats["ratio_sum"] == 3.0 and stats["ratio_min"] == stats["ratio_max"] == 1.0


def test_micro_batch_losses_sum_to_step_loss():
    # Splitting the example into its two samples, each with the same step-wide norm, sums to the whole.
    whole = _example()
    loss, _ = policy_loss(whole, NORM, LossSpec())
    loss.backward()
    parts, grads = [], []
    for sl in (slice(0, 4), slice(4, 7)):
        lp = whole.train_logprobs.detach()[sl].clone().requires_grad_(True)
        part = LossBatch(
            lp,
            whole.sampler_logprobs[sl],
            whole.advantages[sl],
            whole.loss_mask[sl],
            torch.tensor([sl.stop - sl.start]),
        )
        part_loss, stats = policy_loss(part, NORM, LossSpec())
        part_loss.backward()
        parts.append((part_loss.item(), stats))
        grads.append(lp.grad)
    assert parts[0][0] + parts[1][0] == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), whole.train_logprobs.grad)
    assert parts[0][1]["loss_tokens"] + parts[1][1]["loss_tokens"] == 5
    assert parts[0][1]["masked_tokens"] + parts[1][1]["masked_tokens"] == 3


def test_zero_length_completion_and_empty_micro_batch():
    # A sample with 0 loss tokens (prompt only, e.g. the sampler stopped at once) contributes nothing
    # and is not counted as a sample; a micro-batch with no loss token gives loss 0 and no gradient.
    train_logprobs = torch.tensor([-1.0, -2.0, -0.5, -0.25], dtype=F64, requires_grad=True)
    mask = torch.tensor([False, False, False, True])
    assert loss_counts(mask, torch.tensor([2, 2])) == (1, 1)  # only sample 1 has a loss token
    batch = LossBatch(train_logprobs, train_logprobs.detach(), torch.ones(4, dtype=F64), mask, torch.tensor([2, 2]))
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        train_logprobs.grad = None
        loss, _ = policy_loss(batch, StepNorm(1, 1, 4), LossSpec(aggregation=aggregation))
        loss.backward()
        # the one loss token: ratio 1, A 1 -> grad -1 / (N=1 | n_1 G = 1 | L G = 4)
        expected = -1.0 / 4 if aggregation == "seq_mean_token_sum_norm" else -1.0
        assert train_logprobs.grad.tolist() == [0.0, 0.0, 0.0, expected]
    empty = LossBatch(
        train_logprobs,
        train_logprobs.detach(),
        torch.ones(4, dtype=F64),
        torch.zeros(4, dtype=torch.bool),
        torch.tensor([2, 2]),
    )
    train_logprobs.grad = None
    loss, stats = policy_loss(empty, StepNorm(0, 0, 4), LossSpec())
    loss.backward()
    assert loss.item() == 0.0 and train_logprobs.grad.tolist() == [0.0] * 4
    assert stats["loss_tokens"] == 0 and stats["ratio_sum"] == 0 and stats["kl_sum"] == 0
    assert stats["ratio_min"] == math.inf and stats["ratio_max"] == -math.inf


def test_extreme_ratios_give_finite_loss_and_zero_grad_there():
    # token 1 has log ratio 1000 (ratio overflows to inf), token 0 is a prompt token whose
    # sampler_logprobs is -inf and token 3 one whose train_logprobs is NaN: none may leak NaN into loss or grad.
    train_logprobs = torch.tensor([-1.0, -0.5, -1.0, math.nan], dtype=F64, requires_grad=True)
    sampler_logprobs = torch.tensor([-math.inf, -1000.5, -1.0, -1.0], dtype=F64)
    mask = torch.tensor([False, True, True, False])
    batch = LossBatch(train_logprobs, sampler_logprobs, torch.ones(4, dtype=F64), mask, torch.tensor([4]))
    loss, stats = policy_loss(batch, StepNorm(2, 1, 4), LossSpec(geo_mask_high=math.inf))
    # only token 2 kept: coeff 1 -> loss = -(1 * -1.0) / 2 = 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert train_logprobs.grad.tolist() == [0.0, 0.0, -0.5, 0.0]
    assert stats["masked_tokens"] == 1


def test_bad_inputs_raise_value_error():
    b = _example()
    with pytest.raises(ValueError, match=r"sampler_logprobs must be a tensor of shape \[7\]"):
        LossBatch(b.train_logprobs, b.sampler_logprobs[:5], b.advantages, b.loss_mask, b.seq_lens)
    with pytest.raises(ValueError, match="seq_lens must sum"):
        LossBatch(b.train_logprobs, b.sampler_logprobs, b.advantages, b.loss_mask, torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="seq_lens must all be >= 1"):
        LossBatch(b.train_logprobs, b.sampler_logprobs, b.advantages, b.loss_mask, torch.tensor([7, 0]))
    with pytest.raises(ValueError, match="loss_mask must be a bool"):
        LossBatch(b.train_logprobs, b.sampler_logprobs, b.advantages, b.loss_mask.int(), b.seq_lens)
    with pytest.raises(ValueError, match="must all be on one device"):
        LossBatch(
            b.train_logprobs,
            b.sampler_logprobs,
            b.advantages,
            b.loss_mask,
            b.seq_lens,
            entropy=torch.zeros(7, device="meta"),
        )
    with pytest.raises(ValueError, match="teacher_logprobs must be a float tensor"):
        LossBatch(
            b.train_logprobs,
            b.sampler_logprobs,
            b.advantages,
            b.loss_mask,
            b.seq_lens,
            teacher_logprobs=torch.zeros(7, dtype=torch.long),
        )
    with pytest.raises(ValueError, match=r"below this micro-batch's 5 loss tokens / 2 samples"):
        policy_loss(b, StepNorm(4, 2, 1), LossSpec())
    with pytest.raises(ValueError, match=r"below this micro-batch's 5 loss tokens / 2 samples"):
        policy_loss(b, StepNorm(5, 1, 1), LossSpec())
    with pytest.raises(ValueError, match="StepNorm.loss_tokens must be an int"):
        StepNorm(10.0, 2, 1)
    with pytest.raises(ValueError, match="StepNorm.max_tokens must be >= 1"):
        StepNorm(10, 2, 0)
    assert StepNorm(np.int64(10), np.int32(2), 3) == StepNorm(10, 2, 3)  # numpy ints accepted

    bad_adv = b.advantages.clone()
    bad_adv[5] = math.nan
    with pytest.raises(ValueError, match="advantages must be finite on loss tokens.*token 5"):
        policy_loss(LossBatch(b.train_logprobs, b.sampler_logprobs, bad_adv, b.loss_mask, b.seq_lens), NORM, LossSpec())
    bad_rollout = b.sampler_logprobs.clone()
    bad_rollout[0] = -math.inf  # not a loss token: accepted
    policy_loss(LossBatch(b.train_logprobs, bad_rollout, b.advantages, b.loss_mask, b.seq_lens), NORM, LossSpec())
    bad_rollout[1] = -math.inf
    with pytest.raises(ValueError, match="sampler_logprobs must be finite on loss tokens.*token 1"):
        policy_loss(LossBatch(b.train_logprobs, bad_rollout, b.advantages, b.loss_mask, b.seq_lens), NORM, LossSpec())


def test_missing_or_bad_optional_inputs_raise():
    with pytest.raises(ValueError, match="LossBatch.old_logprobs is None: use_tis"):
        policy_loss(_example(), NORM, LossSpec(use_tis=True))
    with pytest.raises(ValueError, match="LossBatch.ref_logprobs is None"):
        policy_loss(_example(), NORM, LossSpec(kl_tau=0.1, kl_reference="reference"))
    with pytest.raises(ValueError, match="LossBatch.teacher_logprobs is None: teacher_tau"):
        policy_loss(_example(), NORM, LossSpec(teacher_tau=0.5))
    bad = torch.zeros(7, dtype=F64)
    bad[6] = math.nan
    with pytest.raises(ValueError, match="old_logprobs must be finite on loss tokens.*token 6"):
        policy_loss(_example(old_logprobs=bad), NORM, LossSpec(use_tis=True))
    with pytest.raises(ValueError, match="teacher_logprobs must be finite on loss tokens.*token 6"):
        policy_loss(_example(teacher_logprobs=bad), NORM, LossSpec())
    policy_loss(_example(ref_logprobs=bad), NORM, LossSpec())  # ref_logprobs unused (kl_tau = 0): not checked
