"""Tests for trainer.trainer.Trainer: one optimizer step over packed micro-batches, on a tiny real
Qwen2 model (full fine-tuning and LoRA).

Samples carry the model's own logprobs as ``sampler_logprobs`` (computed with
``packed_token_logprobs`` under no_grad), so the importance ratio is exactly 1 up to numerics and
the loss reduces to ``-sum_t A_t * lp_t / N`` over loss tokens.

The non-finite guard tests poison one sample: a huge (finite) advantage overflows the float32 loss
to inf; a gradient hook injects NaN into one weight's gradient with a finite loss.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from bus.messages import ScoredGroup
from configs.schema import LoraSection, OptimConfig, TrainerConfig
from trainer.state.model import load_policy
from trainer.forward.packed import packed_token_logprobs
from trainer.observability.step_keys import undocumented
from trainer.trainer import Trainer
from tests.scored_groups import packed_step, sample_tokens, scored

# (prompt tokens, completion tokens, advantage, reward)
SPECS = [
    ([1, 2, 3], [40, 41, 42, 43], 1.0, 1.0),
    ([4, 5], [60, 61, 62], -1.0, 0.0),
    ([7, 8, 9, 10], [80, 81], 0.5, 0.75),
    ([11], [100, 101, 102, 103, 104], -0.5, 0.25),
]


def policy(model_dir: str, lora: bool) -> torch.nn.Module:
    torch.manual_seed(1)  # peft's lora_A init
    return load_policy(model_dir, LoraSection(enabled=lora, rank=4, alpha=8.0))


def trainer_cfg(lr: float = 1e-3) -> TrainerConfig:
    return TrainerConfig(optim=OptimConfig(lr=lr, max_grad_norm=1e9))


def own_logprobs(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """The model's logprob of each token of one unpacked sample (0 on the first)."""
    with torch.no_grad():
        lp = packed_token_logprobs(model, torch.tensor(ids), torch.tensor([len(ids)]), temperature=temperature)
    return lp.numpy().astype(np.float32)


def samples(model, specs=SPECS, version: int = 0, temperature: float = 1.0) -> list[ScoredGroup]:
    """One single-sample group per spec, with the model's own logprobs as sampler logprobs."""
    out = []
    for k, (prompt, comp, adv, rew) in enumerate(specs):
        lps = own_logprobs(model, prompt + comp, temperature)[len(prompt) :]
        out.append(
            scored(
                f"g{k}",
                prompt,
                [comp],
                version=version,
                advantages=[adv],
                rewards=[rew],
                logprobs=[lps],
                temperature=temperature,
            )
        )
    return out


def micro_batches(ss: list[ScoredGroup], split: list[list[int]], step: int = 0):
    return packed_step(ss, split, step=step)


def completion_logprob(model, s: ScoredGroup) -> float:
    ids, mask = sample_tokens(s)
    return float(own_logprobs(model, ids.tolist())[mask].sum())


def advantage(s: ScoredGroup) -> float:
    return float(s.advantages[0])


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_on_policy_step_metrics_and_update(model_dir, lora):
    model = policy(model_dir, lora)
    ss = samples(model)
    mbs = micro_batches(ss, [[0, 1], [2, 3]])
    trainer = Trainer(model, trainer_cfg())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = trainable(model)
    # by hand: ratio 1 -> loss = -sum_samples A_k * sum_completion lp / N, N = 4 + 3 + 2 + 5 = 14
    n_loss = 14
    loss_by_hand = -sum(advantage(s) * float(s.sampler_logprobs.sum()) for s in ss) / n_loss
    m = trainer.step(mbs)
    assert m["loss"] == pytest.approx(loss_by_hand, rel=1e-5)
    assert undocumented(m) == []  # every key has its row in trainer.observability.step_keys.STEP_KEYS
    assert abs(m["kl"]) < 1e-9
    assert m["masked_frac"] == 0.0
    assert m["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["importance_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert m["importance_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["onpolicy_tokens"] == n_loss and m["onpolicy_lp_diff_max"] < 1e-5
    assert m["num_loss_tokens"] == n_loss and m["num_tokens"] == 3 + 4 + 2 + 3 + 4 + 2 + 1 + 5
    assert m["num_samples"] == 4 and m["num_micro_batches"] == 2
    # rewards [1, 0, 0.75, 0.25]: mean 0.5, population std sqrt((0.25+0.25+0.0625+0.0625)/4) = sqrt(0.15625)
    assert m["reward_mean"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx(0.15625**0.5)
    assert m["grad_norm"] > 0
    after = trainable(model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    if lora:
        assert all("lora_" in n for n in before)
        assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    for n, p in model.named_parameters():  # frozen base weights stay frozen
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step_moves_logprobs_in_the_advantage_direction(model_dir, lora):
    base = policy(model_dir, lora)
    for k, sign in ((0, +1), (1, -1)):  # sample 0 has A = +1, sample 1 has A = -1
        model = copy.deepcopy(base)
        (s,) = samples(model, [SPECS[k]])
        lp_before = completion_logprob(model, s)
        Trainer(model, trainer_cfg(lr=1e-4)).step(micro_batches([s], [[0]]))
        delta = completion_logprob(model, s) - lp_before
        assert sign * delta > 1e-5, (k, delta)
    # both in one step: the A-weighted sum of completion logprobs (the objective) goes up
    model = copy.deepcopy(base)
    ss = samples(model, SPECS[:2])
    objective = lambda: sum(advantage(s) * completion_logprob(model, s) for s in ss)
    before = objective()
    Trainer(model, trainer_cfg(lr=1e-4)).step(micro_batches(ss, [[0, 1]]))
    assert objective() > before


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_or_two_micro_batches_give_the_same_gradient(model_dir, lora):
    model = policy(model_dir, lora)
    ss = samples(model)
    trainer = Trainer(model, trainer_cfg())
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def grads(split):
        trainer.optimizer.zero_grad(set_to_none=True)
        total = sum(trainer.micro_step(mb)[0] for mb in micro_batches(ss, split))
        return total, {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}

    loss1, g1 = grads([[0, 1, 2, 3]])
    loss2, g2 = grads([[3, 0], [2, 1]])
    loss4, g4 = grads([[0], [1], [2], [3]])
    assert loss1 == pytest.approx(loss2, rel=1e-5) and loss1 == pytest.approx(loss4, rel=1e-5)
    assert set(g1) == set(g2) == set(g4) and g1
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(g4[n], g1[n], rtol=1e-5, atol=1e-7, msg=n)
    # and whole steps agree on loss and (pre-clip) gradient norm. Parameters after AdamW are not
    # compared: its first update is ~lr * sign(g), which amplifies float noise where g ~ 0.
    s1 = Trainer(copy.deepcopy(model), trainer_cfg()).step(micro_batches(ss, [[0, 1, 2, 3]]))
    s2 = Trainer(copy.deepcopy(model), trainer_cfg()).step(micro_batches(ss, [[3, 0], [2, 1]]))
    assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-5)
    assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-5)
    norm_by_hand = sum(float((g**2).sum()) for g in g1.values()) ** 0.5
    assert s1["grad_norm"] == pytest.approx(norm_by_hand, rel=1e-5)


def test_temperature_is_applied_to_trainer_logprobs(model_dir):
    model = policy(model_dir, lora=False)
    ss = samples(model, temperature=0.7)  # sampler at T = 0.7, recorded in the micro-batch
    m = Trainer(copy.deepcopy(model), trainer_cfg()).step(micro_batches(ss, [[0, 1, 2, 3]]))
    assert m["onpolicy_lp_diff_max"] < 1e-5 and abs(m["kl"]) < 1e-9
    # the same logprobs labelled T = 1: the trainer's logprobs no longer match the sampler's
    wrong = [dataclasses.replace(s, temperature=1.0) for s in ss]
    m = Trainer(copy.deepcopy(model), trainer_cfg()).step(micro_batches(wrong, [[0, 1, 2, 3]]))
    assert m["onpolicy_lp_diff_max"] > 1e-3 and m["kl"] > 1e-6


@pytest.mark.parametrize("with_reference", [False, True], ids=["policy", "policy_and_reference"])
def test_each_micro_batch_uses_its_own_temperature(model_dir, with_reference):
    """Two micro-batches of one step sampled at T = 0.5 and T = 1.5: the trainer's logprobs of
    each sample are log_softmax(logits / T) of its micro-batch's T (against an unpacked
    full-vocabulary forward here), and so are the frozen reference policy's."""
    model = policy(model_dir, lora=False)
    cold, hot = samples(model, SPECS[:2], temperature=0.5), samples(model, SPECS[2:], temperature=1.5)
    mbs = micro_batches(cold + hot, [[0, 1], [2, 3]])
    assert [mb.temperature for mb in mbs] == [0.5, 1.5]
    cfg = trainer_cfg()
    if with_reference:
        cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"kl_tau": 0.1, "kl_reference": "reference"})})
    trainer = Trainer(model, cfg)
    assert (trainer.reference is not None) == with_reference
    for mb, temperature in zip(mbs, (0.5, 1.5)):
        input_ids, seq_lens = (
            torch.tensor(mb.input_ids, dtype=torch.int64),
            torch.tensor(mb.seq_lens, dtype=torch.int64),
        )
        trainer.set_temperature(mb.temperature)
        lp = trainer.logprobs(input_ids, seq_lens)[0].detach()
        start = 0
        for n in mb.seq_lens.tolist():
            ids = input_ids[start : start + n]
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0].float()
            expected = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(1, ids[1:, None])[:, 0]
            torch.testing.assert_close(lp[start + 1 : start + n], expected, rtol=1e-5, atol=1e-5)
            start += n
        if with_reference:
            ref = trainer.reference.logprobs(input_ids, seq_lens, mb.temperature)
            torch.testing.assert_close(ref, lp, rtol=1e-5, atol=1e-6)
    m = trainer.step(mbs)  # a whole step: every micro-batch matches its sampler's logprobs
    assert undocumented(m) == []  # kl_penalty too, with the reference
    assert m["onpolicy_lp_diff_max"] < 1e-5 and abs(m["kl"]) < 1e-9
    if with_reference:
        assert abs(m["kl_penalty"]) < 1e-9  # the reference (= the start policy) at the same T


def test_reward_terms_step_means(model_dir):
    model = policy(model_dir, lora=False)
    terms = [
        {"gsm8k": 1.0, "format": 0.5},
        {"gsm8k": 0.0, "format": 1.0},
        {"gsm8k": 1.0, "format": 0.0},
        {"gsm8k": 0.0},
    ]
    ss = [dataclasses.replace(s, reward_terms={k: [v] for k, v in t.items()}) for s, t in zip(samples(model), terms)]
    mbs = micro_batches(ss, [[0, 1, 2], [3]])
    assert mbs[0].reward_terms == {"format": [0.5, 1.0, 0.0], "gsm8k": [1.0, 0.0, 1.0]}
    assert mbs[1].reward_terms == {"gsm8k": [0.0]}
    m = Trainer(model, trainer_cfg()).step(mbs)
    assert m["reward/gsm8k"] == pytest.approx(0.5)  # 2 of 4
    assert m["reward/format"] == pytest.approx(0.5)  # over the 3 samples that carry it


def test_off_policy_samples_are_not_counted_as_on_policy(model_dir):
    model = policy(model_dir, lora=False)
    ss = samples(model, version=0)
    m = Trainer(model, trainer_cfg()).step(micro_batches(ss, [[0, 1, 2, 3]], step=1))
    assert m["onpolicy_tokens"] == 0 and m["onpolicy_lp_diff_max"] == 0.0
    assert m["num_loss_tokens"] == 14


def test_zero_length_completion_contributes_nothing(model_dir):
    model = policy(model_dir, lora=False)
    ss = samples(model, SPECS[:1]) + [scored("empty", [5, 6, 7], [[]], advantages=[3.0], rewards=[0.0])]
    m = Trainer(model, trainer_cfg()).step(micro_batches(ss, [[0, 1]]))
    lp = float(ss[0].sampler_logprobs.sum())
    assert m["loss"] == pytest.approx(-1.0 * lp / 4, rel=1e-5)  # only sample 0's 4 tokens count
    assert m["num_loss_tokens"] == 4 and m["num_samples"] == 2


def test_step_rejects_empty_or_mixed_steps(model_dir):
    model = policy(model_dir, lora=False)
    trainer = Trainer(model, trainer_cfg())
    ss = samples(model, SPECS[:2])
    with pytest.raises(ValueError):
        trainer.step([])
    mixed = micro_batches(ss, [[0]], step=0) + micro_batches(ss, [[1]], step=1)
    with pytest.raises(ValueError):
        trainer.step(mixed)


def skipped_count(reason: str) -> float:
    return REGISTRY.get_sample_value("rlbus_trainer_skipped_steps_total", {"reason": reason}) or 0.0


def all_weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_huge_sampler_logprobs_are_masked_not_skipped(model_dir):
    """An absurd sampler_logprobs makes the ratio 0 or inf; the loss masks those tokens, so the step is
    finite and taken (the guard is for what the masks cannot catch)."""
    model = policy(model_dir, lora=False)
    ss = samples(model)
    ss[1] = dataclasses.replace(ss[1], sampler_logprobs=np.full_like(ss[1].sampler_logprobs, 1e30))
    before = skipped_count("non_finite_loss") + skipped_count("non_finite_grad")
    m = Trainer(model, trainer_cfg()).step(micro_batches(ss, [[0, 1], [2, 3]]))
    assert m["skipped"] == 0.0 and m["masked_frac"] > 0
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    assert skipped_count("non_finite_loss") + skipped_count("non_finite_grad") == before


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_non_finite_loss_skips_the_step(model_dir, lora, caplog):
    model = policy(model_dir, lora)
    ss = samples(model)
    # a finite but huge advantage (valid on the wire) overflows coeff * train_logprobs to inf in float32
    bad = ss[:1] + [dataclasses.replace(ss[1], advantages=np.float32([3e38]))] + ss[2:]
    trainer = Trainer(model, trainer_cfg())
    weights, before = all_weights(model), skipped_count("non_finite_loss")
    with caplog.at_level(logging.WARNING, logger="trainer.trainer"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch warning about the scheduler stepping without AdamW
        m = trainer.step(micro_batches(bad, [[0, 1], [2, 3]]))
    assert m["skipped"] == 1.0 and not math.isfinite(m["loss"])
    assert "non_finite_loss" in caplog.text
    assert skipped_count("non_finite_loss") == before + 1
    assert_bit_identical(weights, all_weights(model))
    assert not trainer.optimizer.state  # AdamW never stepped: no moments, no step count
    assert all(p.grad is None for p in model.parameters())
    # the next, healthy step is taken and matches a trainer that never saw the bad step
    m = trainer.step(micro_batches(ss, [[0, 1], [2, 3]]))
    assert m["skipped"] == 0.0 and math.isfinite(m["loss"])
    reference = policy(model_dir, lora)
    Trainer(reference, trainer_cfg()).step(micro_batches(ss, [[0, 1], [2, 3]]))
    assert_bit_identical(all_weights(reference), all_weights(model))


def test_non_finite_gradient_skips_the_step(model_dir, caplog):
    model = policy(model_dir, lora=False)
    ss = samples(model)
    trainer = Trainer(model, trainer_cfg())
    trainer.step(micro_batches(ss, [[0, 1, 2, 3]]))  # AdamW has state now: it must not change either
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    weights, before = all_weights(model), skipped_count("non_finite_grad")
    param = model.get_submodule("model.layers.1.mlp.down_proj").weight
    hook = param.register_hook(lambda g: torch.full_like(g, math.nan))  # finite loss, NaN gradient
    with caplog.at_level(logging.WARNING, logger="trainer.trainer"):
        m = trainer.step(micro_batches(ss, [[0, 1], [2, 3]]))
    hook.remove()
    assert m["skipped"] == 1.0 and math.isfinite(m["loss"]) and math.isnan(m["grad_norm"])
    assert "non_finite_grad" in caplog.text
    assert skipped_count("non_finite_grad") == before + 1
    assert_bit_identical(weights, all_weights(model))
    after = trainer.optimizer.state_dict()
    assert after["state"].keys() == opt_state["state"].keys()
    for k, st in opt_state["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(after["state"][k][name]), torch.as_tensor(value)), (k, name)
    m = trainer.step(micro_batches(ss, [[0, 1, 2, 3]]))
    assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    assert any(not torch.equal(weights[n], t) for n, t in all_weights(model).items())
