"""Micro-batch invariance: one optimizer step's gradient does not depend on how its samples are
split into micro-batches (issue 4, item 4), for every loss type and aggregation.

Real pieces: the tiny Qwen2 of `conftest.py` in float64, the packer's `fill_step`, the
trainer's `Trainer.step` (packed chunked forward, `policy_loss`, gradient accumulation). The
sampler's logprobs are the model's own plus noise, so importance ratios spread around 1 and the
masks and clips actually fire (the test checks that they do, else it would prove little).

Why it holds: every micro-batch loss is normalized by STEP-wide totals (`step_loss_tokens`,
`step_samples`, `max_tokens`) and samples are never split, so the step loss is a sum of per-sample
terms whatever the grouping; only float64 rounding can differ (tolerance 1e-6 relative, as the
issue asks; measured differences are ~1e-15).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from configs.schema import LoraSection, LossConfig, OptimConfig, TrainerConfig
from packer.packing import plan_step_micro_batches
from tests.scored_groups import packed_step, scored
from trainer.state.model import load_policy
from trainer.forward.packed import packed_token_logprobs
from trainer.trainer import Trainer

MAX_TOKENS = 12
LOSSES = {
    "aipo_token_mean": dict(),
    "aipo_sequence_seq_mean_token_mean": dict(ratio_type="sequence", aggregation="seq_mean_token_mean"),
    "ppo_clip_dual_drgrpo": dict(type="ppo_clip", eps_clip=0.1, eps_clip_c=2.0, aggregation="seq_mean_token_sum_norm"),
    "importance_sampling_tis_icepop_kl_teacher": dict(
        type="importance_sampling",
        use_tis=True,
        icepop_beta=1.5,
        kl_tau=0.1,
        kl_estimator="k3",
        teacher_tau=0.3,
        aggregation="seq_mean_token_mean",
    ),
    "gspo": dict(type="gspo", eps_clip=0.05, eps_clip_high=0.08),
    "ppo_clip_kl_reference_k2": dict(type="ppo_clip", kl_tau=0.2, kl_estimator="k2", kl_reference="reference"),
}


@pytest.fixture(scope="module")
def model64(model_dir):
    model = load_policy(model_dir, LoraSection(enabled=False))
    return model.double()


@pytest.fixture(scope="module")
def step_samples(model64):
    """12 samples: random prompt/completion lengths (one completion empty), noisy sampler logprobs."""
    rng = np.random.default_rng(7)
    samples, teacher = [], {}
    for k in range(12):
        prompt = rng.integers(1, 300, size=int(rng.integers(1, 6))).tolist()
        n_comp = 0 if k == 5 else int(rng.integers(1, MAX_TOKENS + 1))
        ids = prompt + rng.integers(1, 300, size=n_comp).tolist()
        mask = np.array([False] * len(prompt) + [True] * n_comp)
        with torch.no_grad():
            own_t = packed_token_logprobs(model64, torch.tensor(ids), torch.tensor([len(ids)]))
        assert own_t.dtype == torch.float64  # the whole path runs in float64
        own = own_t.numpy()
        noisy = np.where(mask, own + rng.normal(0.0, 0.3, len(ids)), 0.0)
        gid = f"g{k}"
        comp = ids[len(prompt) :]
        samples.append(scored(gid, prompt, [comp], advantages=[rng.normal()], logprobs=[noisy[mask]]))
        teacher[f"{gid}/0"] = np.where(mask, own + rng.normal(0.0, 0.5, len(ids)), 0.0).astype(np.float32)
    return samples, teacher


def micro_batches(samples, teacher, bins):
    return [
        dataclasses.replace(mb, teacher_logprobs=np.concatenate([teacher[i] for i in mb.sample_ids]))
        for mb in packed_step(samples, bins)
    ]


def splits(samples) -> dict[str, list[list[int]]]:
    """The same step as one micro-batch, as best-fit packed bins, and as a shuffled 5-way split."""
    n = len(samples)
    lengths = [len(g.prompt_ids) + int(g.completion_lens.sum()) for g in samples]
    packed = [b for b in plan_step_micro_batches(lengths, 24, 1)[0] if b]
    order = np.random.default_rng(3).permutation(n).tolist()
    return {"one": [list(range(n))], "packed": packed, "shuffled": [order[i::5] for i in range(5)]}


def step_gradient(model, loss_kwargs, mbs) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Gradient of one `Trainer.step` (read after the step: clipping is off, max_grad_norm=1e9)."""
    cfg = TrainerConfig(loss=LossConfig(**loss_kwargs), optim=OptimConfig(lr=1e-3, max_grad_norm=1e9))
    policy = copy.deepcopy(model)
    metrics = Trainer(policy, cfg, max_tokens=MAX_TOKENS).step(mbs)
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}, metrics


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_step_gradient_is_the_same_whatever_the_micro_batch_split(model64, step_samples, name):
    samples, teacher = step_samples
    ways = splits(samples)
    assert len(ways["packed"]) >= 3  # the split is a real one
    grads = {}
    for way, bins in ways.items():
        grads[way], metrics = step_gradient(model64, LOSSES[name], micro_batches(samples, teacher, bins))
        assert metrics["skipped"] == 0.0 and metrics["num_micro_batches"] == len(bins)
    reference = grads["one"]
    scale = max(float(g.abs().max()) for g in reference.values())
    assert scale > 0
    for way in ("packed", "shuffled"):
        assert grads[way].keys() == reference.keys()
        worst = max(float((grads[way][n] - reference[n]).abs().max()) for n in reference)
        assert worst <= 1e-6 * scale, f"{name}: {way} differs from one micro-batch by {worst / scale:.2e} (relative)"


def test_masks_and_clips_fire_in_the_invariance_data(model64, step_samples):
    """Guard against a vacuous invariance test: the noisy ratios must trigger masks and clips."""
    samples, teacher = step_samples
    mbs = micro_batches(samples, teacher, splits(samples)["packed"])
    _, aipo = step_gradient(model64, dict(token_mask_low=0.7, token_mask_high=1.4), mbs)
    _, ppo = step_gradient(model64, LOSSES["ppo_clip_dual_drgrpo"], mbs)
    assert aipo["masked_frac"] > 0.05 and ppo["clipfrac"] > 0.05
    assert aipo["importance_ratio_min"] < 0.8 < 1.25 < aipo["importance_ratio_max"]
