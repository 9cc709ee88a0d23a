"""Tests for the loss types ppo_clip, importance_sampling and gspo (and aipo on the same data)
through trainer.loss.policy_loss, against values and gradients computed by hand in float64.

Example (2 packed samples, T = 7), ratios r = pi_train / pi_rollout chosen to hit every clip case:

    token           0      1      2      3      4      5      6
    sample          0      0      0      0      1      1      1
    loss_mask       F      T      T      T      F      T      T
    train_logprobs      -1.0   -0.5   -2.0  -0.25   -3.0   -1.5  -0.75
    ratio           1      1     1.1    1.5     1     0.5     4
    advantage      1.0    1.0    1.0    1.0   -2.0   -2.0   -2.0

Step normalizer N = 10 loss tokens (the step is larger than this micro-batch), G = 4 samples.
"""

import math

import pytest
import torch

from trainer.losses import LossBatch, LossSpec, StepNorm, policy_loss

torch.set_num_threads(1)
F64 = torch.float64
RATIOS = [1.0, 1.0, 1.1, 1.5, 1.0, 0.5, 4.0]
NORM = StepNorm(loss_tokens=10, num_samples=4, max_tokens=8)


def _example(**extra):
    train_logprobs = torch.tensor([-1.0, -0.5, -2.0, -0.25, -3.0, -1.5, -0.75], dtype=F64, requires_grad=True)
    return LossBatch(
        train_logprobs=train_logprobs,
        sampler_logprobs=train_logprobs.detach() - torch.log(torch.tensor(RATIOS, dtype=F64)),
        advantages=torch.tensor([1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0], dtype=F64),
        loss_mask=torch.tensor([False, True, True, True, False, True, True]),
        seq_lens=torch.tensor([4, 3]),
        **extra,
    )


def _run(spec, norm=NORM, **extra):
    batch = _example(**extra)
    loss, stats = policy_loss(batch, norm, spec)
    loss.backward()
    return loss.item(), batch.train_logprobs.grad, stats


def test_ppo_clip_by_hand():
    # eps 0.2: clip range [0.8, 1.2]. Token loss max(-A r, -A clip(r)):
    #   t1: r 1,   A 1  -> max(-1, -1)         = -1     (not clipped)
    #   t2: r 1.1, A 1  -> max(-1.1, -1.1)     = -1.1   (not clipped)
    #   t3: r 1.5, A 1  -> max(-1.5, -1.2)     = -1.2   (clipped: r > 1.2 with A > 0)
    #   t5: r 0.5, A -2 -> max(1.0, 1.6)       = 1.6    (clipped: r < 0.8 with A < 0)
    #   t6: r 4,   A -2 -> max(8.0, 2.4)       = 8.0    (not clipped)
    # loss = (-1 - 1.1 - 1.2 + 1.6 + 8.0) / 10 = 0.63
    # grad = -A r / 10 where not clipped: t1 -0.1, t2 -0.11, t6 +0.8
    loss, grad, stats = _run(LossSpec(type="ppo_clip", eps_clip=0.2))
    assert loss == pytest.approx(0.63, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0, -0.1, -0.11, 0, 0, 0, 0.8], dtype=F64))
    assert stats["clipped_tokens"] == 2 and stats["masked_tokens"] == 0


def test_ppo_dual_clip_by_hand():
    # eps_clip_c 3: a negative-advantage token's loss is at most -A * 3 = 6:
    #   t6: min(8.0, 6.0) = 6 (dual clipped, zero gradient); t5: min(1.6, 6) = 1.6 (unchanged)
    # loss = (-1 - 1.1 - 1.2 + 1.6 + 6.0) / 10 = 0.43
    loss, grad, stats = _run(LossSpec(type="ppo_clip", eps_clip=0.2, eps_clip_c=3.0))
    assert loss == pytest.approx(0.43, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0, -0.1, -0.11, 0, 0, 0, 0], dtype=F64))
    assert stats["clipped_tokens"] == 3


def test_ppo_asymmetric_clip_by_hand():
    # eps_clip 0.6 (lower bound 0.4), eps_clip_high 0.6 (upper 1.6): nothing is clipped but t6;
    #   t5: r 0.5 >= 0.4 -> 1.0 ; t6: max(8.0, 2 * 1.6 = 3.2) = 8.0 (not clipped: A < 0)
    # -> identical to importance sampling here: (-1 - 1.1 - 1.5 + 1.0 + 8.0) / 10 = 0.54
    # eps_clip_high 0.3 (upper 1.3) clips t3: -1.3 instead of -1.5 -> 0.56
    loss, _, stats = _run(LossSpec(type="ppo_clip", eps_clip=0.6))
    assert loss == pytest.approx(0.54, rel=1e-12) and stats["clipped_tokens"] == 0
    loss, grad, stats = _run(LossSpec(type="ppo_clip", eps_clip=0.6, eps_clip_high=0.3))
    assert loss == pytest.approx(0.56, rel=1e-12) and stats["clipped_tokens"] == 1
    torch.testing.assert_close(grad, torch.tensor([0, -0.1, -0.11, 0, 0, 0.1, 0.8], dtype=F64))


def test_importance_sampling_by_hand():
    # loss_t = -(r A): -1, -1.1, -1.5, +1.0, +8.0 -> sum 5.4 -> /10 = 0.54
    # grad = -A r / 10 = [0, -0.1, -0.11, -0.15, 0, 0.1, 0.8]
    loss, grad, stats = _run(LossSpec(type="importance_sampling"))
    assert loss == pytest.approx(0.54, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0, -0.1, -0.11, -0.15, 0, 0.1, 0.8], dtype=F64))
    assert stats["clipped_tokens"] == 0


def test_aipo_token_on_the_same_example_by_hand():
    # every ratio is inside [0.125, 8] and geo means (1.65^(1/3), 2^(1/2)) inside [0.1, 10]: all kept.
    # loss = -sum_t (r A) lp / 10 = -(1 * -0.5 + 1.1 * -2.0 + 1.5 * -0.25 + (-1.0) * -1.5 + (-8.0) * -0.75) / 10
    #      = -(-0.5 - 2.2 - 0.375 + 1.5 + 6.0) / 10 = -0.4425 ; grad = -r A / 10 (same as IS)
    loss, grad, _ = _run(LossSpec())
    assert loss == pytest.approx(-0.4425, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0, -0.1, -0.11, -0.15, 0, 0.1, 0.8], dtype=F64))


def test_gspo_by_hand():
    # s_i = geometric mean of the sample's token ratios:
    #   s_0 = (1 * 1.1 * 1.5)^(1/3) = 1.65^(1/3) = 1.1816...  s_1 = (0.5 * 4)^(1/2) = 2^(1/2) = 1.4142...
    # eps 0.1 -> clip range [0.9, 1.1]:
    #   sample 0 (A = 1):  max(-s_0, -1.1) = -1.1 on each token (clipped, zero gradient)
    #   sample 1 (A = -2): max(2 s_1, 2 * 1.1) = 2 s_1 = 2.8284 on each token (not clipped)
    # GSPO's aggregation seq_mean_token_mean with G = 4: loss = (-1.1 + 2 sqrt 2) / 4
    # grad (token form): d l_t / d lp_t = -A s_1 = 2 sqrt 2, times weight 1 / (n_1 G) = 1 / 8
    spec = LossSpec(type="gspo", eps_clip=0.1, aggregation="seq_mean_token_mean")
    loss, grad, stats = _run(spec)
    s1 = math.sqrt(2.0)
    assert loss == pytest.approx((-1.1 + 2 * s1) / 4, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0, 0, 0, 0, 0, 2 * s1 / 8, 2 * s1 / 8], dtype=F64))
    assert stats["clipped_tokens"] == 3


def test_gspo_gradient_equals_the_sequence_form():
    # GSPO's own (sequence-level) objective, differentiated directly:
    #   J = (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i), s_i = exp(mean_t (lp_t - lp_rollout_t))
    # gives d(-J)/d lp_t = -(1/G) A_i s_i / |y_i| when unclipped: the token form must match it.
    eps = 0.3  # [0.7, 1.3]: sample 0 (s 1.18) unclipped, sample 1 (A < 0, s 1.41) unclipped
    loss, grad, _ = _run(LossSpec(type="gspo", eps_clip=eps, aggregation="seq_mean_token_mean"), StepNorm(5, 2, 8))
    ex = _example()
    lp = ex.train_logprobs
    terms = []
    for sl, adv in ((slice(1, 4), 1.0), (slice(5, 7), -2.0)):
        s = torch.exp((lp[sl] - ex.sampler_logprobs[sl]).mean())
        terms.append(torch.minimum(s * adv, s.clamp(1 - eps, 1 + eps) * adv))
    seq_loss = -(terms[0] + terms[1]) / 2
    seq_loss.backward()
    assert loss == pytest.approx(seq_loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, lp.grad)


def test_gspo_with_per_sample_advantage_is_clipped_per_sample():
    # GSPO clips whole samples. Clip range [0.5, 1.2], both advantages positive (sample 1: A = +2):
    #   sample 0: s_0 = 1.18 < 1.2 -> unclipped, -s_0 per token, grad -s_0 / (n_0 G) = -s_0 / 12
    #   sample 1: s_1 = 1.41 > 1.2 -> max(-2 s_1, -2 * 1.2) = -2.4 per token, clipped, zero gradient
    batch = _example()
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0], dtype=F64)
    batch = LossBatch(batch.train_logprobs, batch.sampler_logprobs, adv, batch.loss_mask, batch.seq_lens)
    loss, stats = policy_loss(
        batch, NORM, LossSpec(type="gspo", eps_clip=0.5, eps_clip_high=0.2, aggregation="seq_mean_token_mean")
    )
    loss.backward()
    s0 = 1.65 ** (1 / 3)
    # loss = (mean over sample 0 + mean over sample 1) / G = (-s_0 - 2.4) / 4
    assert loss.item() == pytest.approx((-s0 - 2.4) / 4, rel=1e-12)
    torch.testing.assert_close(
        batch.train_logprobs.grad, torch.tensor([0, -s0 / 12, -s0 / 12, -s0 / 12, 0, 0, 0], dtype=F64)
    )
    assert stats["clipped_tokens"] == 2


@pytest.mark.parametrize("loss_type", ["aipo", "ppo_clip", "importance_sampling", "gspo"])
def test_random_gradients_match_closed_form(loss_type):
    # Random packed batch (float64 leaf): autograd gradient == the closed form of each type,
    #   aipo / IS: -A r w_t ;  ppo_clip: -A r w_t unless clipped ;  gspo: -A s_i w_t unless clipped,
    # with w_t = 1 / N (token_mean) and no masks hit (ratios near 1).
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([5, 3, 6, 2])
    t = int(seq_lens.sum())
    lp = (-torch.rand(t, generator=g, dtype=F64) * 3).requires_grad_(True)
    log_r = (torch.rand(t, generator=g, dtype=F64) - 0.5) * 0.8
    adv = torch.repeat_interleave(torch.randn(4, generator=g, dtype=F64), seq_lens)
    mask = torch.rand(t, generator=g) < 0.8
    mask[[0, 5, 8, 14]] = False  # prompt token of each sample
    batch = LossBatch(lp, lp.detach() - log_r, adv, mask, seq_lens)
    n = int(mask.sum())
    loss, _ = policy_loss(
        batch, StepNorm(n, 4, 8), LossSpec(type=loss_type, eps_clip=0.2) if loss_type != "aipo" else LossSpec()
    )
    loss.backward()
    r = torch.exp(log_r)
    if loss_type in ("aipo", "importance_sampling"):
        expected = -adv * r
    elif loss_type == "ppo_clip":
        clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
        expected = torch.where(clipped, 0.0, -adv * r)
    else:
        ids = torch.repeat_interleave(torch.arange(4), seq_lens)
        s = torch.stack([torch.exp(log_r[(ids == i) & mask].mean()) for i in range(4)])[ids]
        clipped = ((adv > 0) & (s > 1.2)) | ((adv < 0) & (s < 0.8))
        expected = torch.where(clipped, 0.0, -adv * s)
    torch.testing.assert_close(lp.grad, torch.where(mask, expected / n, 0.0))
