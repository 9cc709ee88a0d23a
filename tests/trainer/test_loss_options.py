"""Tests for the options valid with every loss type (IcePop, TIS, KL penalty, on-policy
distillation), the three aggregations, the edge cases of GRPO batches, and micro-batch / rank
split invariance, through trainer.loss.policy_loss, against values computed by hand in float64.

Example (the one of test_loss_types.py; 2 packed samples, T = 7):

    token           0      1      2      3      4      5      6
    sample          0      0      0      0      1      1      1
    loss_mask       F      T      T      T      F      T      T
    train_logprobs      -1.0   -0.5   -2.0  -0.25   -3.0   -1.5  -0.75
    ratio m         1      1     1.1    1.5     1     0.5     4      (pi_train / pi_rollout)
    advantage      1.0    1.0    1.0    1.0   -2.0   -2.0   -2.0

importance_sampling token losses -(m A): t1 -1, t2 -1.1, t3 -1.5, t5 +1.0, t6 +8.0 (sum 5.4);
their gradients -A m: t1 -1, t2 -1.1, t3 -1.5, t5 +1.0, t6 +8.0.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from trainer.losses import LossBatch, LossSpec, StepNorm, loss_counts, policy_loss

torch.set_num_threads(1)
F64 = torch.float64
RATIOS = [1.0, 1.0, 1.1, 1.5, 1.0, 0.5, 4.0]
LP = [-1.0, -0.5, -2.0, -0.25, -3.0, -1.5, -0.75]
NORM = StepNorm(loss_tokens=10, num_samples=4, max_tokens=8)
IS = "importance_sampling"


def _example(advantages=(1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0), **extra):
    train_logprobs = torch.tensor(LP, dtype=F64, requires_grad=True)
    return LossBatch(
        train_logprobs=train_logprobs,
        sampler_logprobs=train_logprobs.detach() - torch.log(torch.tensor(RATIOS, dtype=F64)),
        advantages=torch.tensor(advantages, dtype=F64),
        loss_mask=torch.tensor([False, True, True, True, False, True, True]),
        seq_lens=torch.tensor([4, 3]),
        **extra,
    )


def _run(spec, norm=NORM, **kwargs):
    batch = _example(**kwargs)
    loss, stats = policy_loss(batch, norm, spec)
    loss.backward()
    return loss.item(), batch.train_logprobs.grad, stats


def _grad(values):
    return torch.tensor(values, dtype=F64)


def test_icepop_masks_outside_one_over_beta_beta():
    # beta 3: keep m in [1/3, 3] -> t6 (m = 4) masked, t5 (m = 0.5) kept.
    # IS loss over kept tokens: (-1 - 1.1 - 1.5 + 1.0) / 10 = -0.26 ; t6 gets zero gradient
    loss, grad, stats = _run(LossSpec(type=IS, icepop_beta=3.0))
    assert loss == pytest.approx(-0.26, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, -0.1, -0.11, -0.15, 0, 0.1, 0]))
    assert stats["masked_tokens"] == 1
    # beta 1.2: keep [0.833, 1.2] -> only t1 (m 1) and t2 (m 1.1) kept: (-1 - 1.1) / 10
    loss, _, stats = _run(LossSpec(type="ppo_clip", icepop_beta=1.2))
    assert loss == pytest.approx(-0.21, rel=1e-12) and stats["masked_tokens"] == 3


def test_tis_with_old_policy_equal_to_train():
    # rlbus passes old_logprobs = train_logprobs.detach(): policy ratio pi_train / pi_old = 1 (grad flows),
    # TIS weight w = clip(m, 0.6, 2): t1 1, t2 1.1, t3 1.5, t5 0.6 (truncated), t6 2 (truncated).
    # ppo_clip with r = 1 is never clipped: l_t = w (-A): -1, -1.1, -1.5, +1.2, +4.0 -> 1.6 / 10
    # grad = -A w / 10
    old_logprobs = torch.tensor(LP, dtype=F64)
    loss, grad, stats = _run(
        LossSpec(type="ppo_clip", use_tis=True, tis_clip_low=0.6, tis_clip_high=2.0), old_logprobs=old_logprobs
    )
    assert loss == pytest.approx(0.16, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, -0.1, -0.11, -0.15, 0, 0.12, 0.4]))
    assert stats["tis_clipped_tokens"] == 2 and stats["clipped_tokens"] == 0


def test_tis_with_old_policy_behind_train():
    # old_logprobs = train_logprobs - ln 1.25: policy ratio r = 1.25 on every token; TIS weight
    # w = clip(pi_old / pi_rollout = m / 1.25, 0.6, 2) = 0.8, 0.88, 1.2, 0.6 (0.4 truncated), 2 (3.2 truncated)
    # IS: l_t = w (-A r): -1.0, -1.1, -1.5, +1.5, +5.0 -> 2.9 / 10 ; grad = -A r w / 10
    old_logprobs = torch.tensor(LP, dtype=F64) - math.log(1.25)
    loss, grad, stats = _run(
        LossSpec(type=IS, use_tis=True, tis_clip_low=0.6, tis_clip_high=2.0), old_logprobs=old_logprobs
    )
    assert loss == pytest.approx(0.29, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, -0.1, -0.11, -0.15, 0, 0.15, 0.5]))
    assert stats["tis_clipped_tokens"] == 2
    # the mismatch stats stay pi_train / pi_rollout
    assert stats["ratio_sum"] == pytest.approx(1 + 1.1 + 1.5 + 0.5 + 4, rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_against_rollout_by_hand(estimator):
    # aipo (all kept) + kl_tau 0.1 against the sampler: with x = train_logprobs - sampler_logprobs = ln m,
    #   k1 = x, k2 = x^2 / 2, k3 = e^-x - 1 + x ; d/d train_logprobs: 1, x, 1 - e^-x
    # loss = (sum_t -(m A) lp_t + 0.1 sum_t k(x_t)) / 10 ; grad = (-m A + 0.1 dk) / 10
    x = [math.log(m) for m in RATIOS]
    value = {"k1": lambda v: v, "k2": lambda v: v * v / 2, "k3": lambda v: math.exp(-v) - 1 + v}[estimator]
    slope = {"k1": lambda v: 1.0, "k2": lambda v: v, "k3": lambda v: 1 - math.exp(-v)}[estimator]
    adv = [1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
    loss_tokens = [1, 2, 3, 5, 6]
    policy = sum(-(RATIOS[t] * adv[t]) * LP[t] for t in loss_tokens)
    penalty = sum(value(x[t]) for t in loss_tokens)
    expected_grad = [(-RATIOS[t] * adv[t] + 0.1 * slope(x[t])) / 10 if t in loss_tokens else 0.0 for t in range(7)]
    loss, grad, stats = _run(LossSpec(kl_tau=0.1, kl_estimator=estimator))
    assert loss == pytest.approx((policy + 0.1 * penalty) / 10, rel=1e-12)
    torch.testing.assert_close(grad, _grad(expected_grad))
    assert stats["kl_penalty_sum"] == pytest.approx(penalty, rel=1e-12)


def test_kl_penalty_against_reference_with_zero_advantages():
    # All-equal rewards -> zero advantages: the policy term vanishes, only the KL pull remains.
    # ref_logprobs = train_logprobs - ln 2 on every token, so x = train_logprobs - ref_logprobs = ln 2:
    #   k3 = e^-x - 1 + x = 0.5 - 1 + ln 2 = 0.1931471806 ; d k3 / d train_logprobs = 1 - e^-x = 0.5
    # loss = 0.2 * 5 * 0.1931471806 / 10 ; grad = 0.2 * 0.5 / 10 = 0.01 on loss tokens
    ref_logprobs = torch.tensor(LP, dtype=F64) - math.log(2.0)
    spec = LossSpec(type="ppo_clip", kl_tau=0.2, kl_reference="reference")
    loss, grad, stats = _run(spec, advantages=(0.0,) * 7, ref_logprobs=ref_logprobs)
    k3 = 0.5 - 1 + math.log(2.0)
    assert loss == pytest.approx(0.2 * 5 * k3 / 10, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, 0.01, 0.01, 0.01, 0, 0.01, 0.01]))
    assert stats["kl_penalty_sum"] == pytest.approx(5 * k3, rel=1e-12)


def test_teacher_distillation_by_hand():
    # teacher_logprobs = train_logprobs + d, d = [0, 0.2, -0.4, 0.6, 0, 1.0, -2.0]; teacher_tau 0.5:
    #   A' = A + 0.5 d = t1 1.1, t2 0.8, t3 1.3, t5 -1.5, t6 -3.0 (detached)
    # IS: l_t = -(m A'): -1.1, -0.88, -1.95, +0.75, +12.0 -> 8.82 / 10 ; grad = -m A' / 10
    # teacher_kl_sum = sum (train_logprobs - teacher_logprobs) = -(0.2 - 0.4 + 0.6 + 1.0 - 2.0) = 0.6
    d = torch.tensor([0, 0.2, -0.4, 0.6, 0, 1.0, -2.0], dtype=F64)
    loss, grad, stats = _run(LossSpec(type=IS, teacher_tau=0.5), teacher_logprobs=torch.tensor(LP, dtype=F64) + d)
    assert loss == pytest.approx(0.882, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, -0.11, -0.088, -0.195, 0, 0.075, 1.2]))
    assert stats["teacher_kl_sum"] == pytest.approx(0.6, rel=1e-12)
    # teacher logprobs without teacher_tau: reported only, the loss is plain IS (5.4 / 10)
    loss, _, stats = _run(LossSpec(type=IS), teacher_logprobs=torch.tensor(LP, dtype=F64) + d)
    assert loss == pytest.approx(0.54, rel=1e-12) and stats["teacher_kl_sum"] == pytest.approx(0.6, rel=1e-12)


def test_entropy_stat_sums_loss_tokens():
    entropy = torch.tensor([9.0, 0.5, 1.0, 1.5, 9.0, 2.0, 2.5], dtype=F64)
    _, _, stats = _run(LossSpec(), entropy=entropy)
    assert stats["entropy_sum"] == 7.5  # 0.5 + 1.0 + 1.5 + 2.0 + 2.5; tokens 0 and 4 are not loss tokens


def test_aggregations_by_hand():
    # IS token losses: sample 0 (n_0 = 3): -1, -1.1, -1.5 ; sample 1 (n_1 = 2): +1.0, +8.0
    # token_mean, N = 5:                 (5.4) / 5 = 1.08 ;            grad -A m / 5
    # seq_mean_token_mean, G = 2:        ((-3.6) / 3 + 9 / 2) / 2 = 1.65 ; grad -A m / (n_i G)
    # seq_mean_token_sum_norm, L 8, G 2: 5.4 / (8 * 2) = 0.3375 ;      grad -A m / 16
    g = [0, -1.0, -1.1, -1.5, 0, 1.0, 8.0]  # -A m
    norm = StepNorm(5, 2, 8)
    loss, grad, _ = _run(LossSpec(type=IS, aggregation="token_mean"), norm)
    assert loss == pytest.approx(1.08, rel=1e-12)
    torch.testing.assert_close(grad, _grad([v / 5 for v in g]))
    loss, grad, _ = _run(LossSpec(type=IS, aggregation="seq_mean_token_mean"), norm)
    assert loss == pytest.approx(1.65, rel=1e-12)
    torch.testing.assert_close(grad, _grad([v / (3 * 2) for v in g[:4]] + [v / (2 * 2) for v in g[4:]]))
    loss, grad, _ = _run(LossSpec(type=IS, aggregation="seq_mean_token_sum_norm"), norm)
    assert loss == pytest.approx(0.3375, rel=1e-12)
    torch.testing.assert_close(grad, _grad([v / 16 for v in g]))


@pytest.mark.parametrize("loss_type", ["aipo", "ppo_clip", IS, "gspo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_all_equal_rewards_give_zero_loss_and_gradient(loss_type, aggregation):
    # A group whose rewards are all equal (or a one-sample group) has zero advantage: no policy
    # gradient for any type or aggregation, yet its tokens still count in the stats.
    loss, grad, stats = _run(LossSpec(type=loss_type, aggregation=aggregation), advantages=(0.0,) * 7)
    assert loss == 0.0 and grad.tolist() == [0.0] * 7
    assert stats["loss_tokens"] == 5


def test_one_sample_micro_batch_under_each_aggregation():
    # One sample (a one-sample group packed alone): ratios 1, A = 1, loss tokens 1..3 of 4.
    # lp = [-1, -0.5, -2, -0.25]; IS token losses -1 each, grad -1 each.
    #   token_mean with N = 3: -3 / 3 = -1 ; seq_mean_token_mean with G = 1: mean -1 ;
    #   seq_mean_token_sum_norm with L = 6, G = 1: -3 / 6 = -0.5
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.25], dtype=F64, requires_grad=True)
    batch = LossBatch(
        lp, lp.detach(), torch.ones(4, dtype=F64), torch.tensor([False, True, True, True]), torch.tensor([4])
    )
    for aggregation, value, weight in (
        ("token_mean", -1.0, 1 / 3),
        ("seq_mean_token_mean", -1.0, 1 / 3),
        ("seq_mean_token_sum_norm", -0.5, 1 / 6),
    ):
        lp.grad = None
        loss, _ = policy_loss(batch, StepNorm(3, 1, 6), LossSpec(type=IS, aggregation=aggregation))
        loss.backward()
        assert loss.item() == pytest.approx(value, rel=1e-12)
        torch.testing.assert_close(lp.grad, _grad([0, -weight, -weight, -weight]))


def test_fully_masked_sample_counts_in_the_mean_but_gets_no_gradient():
    # aipo with geo_mask_high 1.3: sample 1 (geo mean sqrt 2 = 1.414) is masked whole; sample 0
    # (1.65^(1/3) = 1.18) kept. seq_mean_token_mean with G = 2 (the masked sample still counts):
    #   sample 0 mean of -(m A lp) = -(1 * -0.5 + 1.1 * -2.0 + 1.5 * -0.25) / 3 = 3.075 / 3 = 1.025
    #   loss = (1.025 + 0) / 2 = 0.5125 ; grad sample 0 = -m A / (3 * 2)
    loss, grad, stats = _run(LossSpec(geo_mask_high=1.3, aggregation="seq_mean_token_mean"), StepNorm(5, 2, 8))
    assert loss == pytest.approx(0.5125, rel=1e-12)
    torch.testing.assert_close(grad, _grad([0, -1 / 6, -1.1 / 6, -1.5 / 6, 0, 0, 0]))
    assert stats["masked_tokens"] == 2


def _random_batch(seed, num_samples=12):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (num_samples,), generator=g)
    t = int(lens.sum())
    lp = -torch.rand(t, generator=g, dtype=F64) * 3
    log_r = (torch.rand(t, generator=g, dtype=F64) - 0.5) * 1.5
    mask = torch.rand(t, generator=g) < 0.75
    mask[torch.cumsum(lens, 0) - lens] = False  # first token of each sample is a prompt token
    mask[int(lens[:2].sum()) : int(lens[:3].sum())] = False  # sample 2: a zero-length completion
    adv = torch.repeat_interleave(torch.randn(num_samples, generator=g, dtype=F64), lens)
    extra = {
        "old_logprobs": lp - (torch.rand(t, generator=g, dtype=F64) - 0.5) * 0.2,
        "ref_logprobs": lp - (torch.rand(t, generator=g, dtype=F64) - 0.5),
        "teacher_logprobs": lp - (torch.rand(t, generator=g, dtype=F64) - 0.5),
    }
    return lens, lp, lp - log_r, adv, mask, extra


SPECS = [
    LossSpec(),
    LossSpec(ratio_type="sequence", sequence_clip_high=1.5, sequence_mask_high=1.9, geo_mask_high=1.3),
    LossSpec(type="ppo_clip", eps_clip=0.1, eps_clip_high=0.15, eps_clip_c=1.5, icepop_beta=1.8),
    LossSpec(type=IS, use_tis=True, tis_clip_low=0.7, tis_clip_high=1.5, kl_tau=0.1, kl_reference="reference"),
    LossSpec(type="gspo", eps_clip=0.05, teacher_tau=0.3, kl_tau=0.05, kl_estimator="k2"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.type + ("-seq" if s.ratio_type == "sequence" else ""))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_any_split_into_micro_batches_and_ranks_sums_to_the_step(spec, aggregation):
    # The step loss computed at once equals the SUM of its micro-batch losses for every split at
    # sample boundaries (micro-batches on one rank, or spread over ranks whose gradients are
    # summed): losses, gradients and summed stats agree.
    spec = dataclasses.replace(spec, aggregation=aggregation)
    lens, lp, sampler_logprobs, adv, mask, extra = _random_batch(seed=5)
    norm = StepNorm(*loss_counts(mask, lens), max_tokens=6)

    def run(lo, hi):  # samples [lo, hi)
        a, b = int(lens[:lo].sum()), int(lens[:hi].sum())
        leaf = lp[a:b].clone().requires_grad_(True)
        batch = LossBatch(
            leaf, sampler_logprobs[a:b], adv[a:b], mask[a:b], lens[lo:hi], **{k: v[a:b] for k, v in extra.items()}
        )
        loss, stats = policy_loss(batch, norm, spec)
        loss.backward()
        return loss.item(), leaf.grad, stats

    whole_loss, whole_grad, whole_stats = run(0, len(lens))
    for cuts in ([3], [1, 5], [2, 4, 7, 9], list(range(1, len(lens)))):
        bounds = [0, *cuts, len(lens)]
        parts = [run(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        assert sum(p[0] for p in parts) == pytest.approx(whole_loss, rel=1e-10, abs=1e-14)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_grad)
        for key in ("loss_tokens", "masked_tokens", "clipped_tokens", "kl_sum", "ratio_sum"):
            assert sum(p[2][key] for p in parts) == pytest.approx(whole_stats[key], rel=1e-10, abs=1e-12)
        assert min(p[2]["ratio_min"] for p in parts) == whole_stats["ratio_min"]
        assert max(p[2]["ratio_max"] for p in parts) == whole_stats["ratio_max"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.type)
def test_masked_and_prompt_tokens_never_leak_nan(spec):
    # Non-loss tokens carry -inf / NaN in every input and one loss token has an absurd ratio
    # (sampler_logprobs 500 nats below train_logprobs): the loss and gradient stay finite, and non-loss
    # tokens get exactly zero gradient.
    lens, lp, sampler_logprobs, adv, mask, extra = _random_batch(seed=5)
    sampler_logprobs = sampler_logprobs.clone()
    first = int(mask.nonzero()[0, 0])
    sampler_logprobs[first] = lp[first] - 500.0
    poison = ~mask
    sampler_logprobs[poison] = -math.inf
    extra = {k: torch.where(poison, math.nan, v) for k, v in extra.items()}
    leaf = torch.where(poison, math.nan, lp).requires_grad_(True)
    batch = LossBatch(leaf, sampler_logprobs, torch.where(poison, math.nan, adv), mask, lens, **extra)
    norm = StepNorm(*loss_counts(mask, lens), max_tokens=6)
    loss, _ = policy_loss(batch, norm, spec)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[poison] == 0).all()
