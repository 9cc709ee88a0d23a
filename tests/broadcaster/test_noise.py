"""QeRL adaptive noise: the stage schedule against hand values, the RMSNorm selection, noisy
copies that leave the trainer's weights clean, and what the trainer process actually sends."""

from __future__ import annotations

import math

import pytest
import torch

from broadcaster.noise import (
    is_rmsnorm_weight,
    qerl_noise_sigma,
    qerl_noise_stage,
    qerl_sigma_trend,
    with_rmsnorm_noise,
)
from configs.schema import LoraSection, NoiseSchedulerConfig, RunConfig
from trainer.state.model import load_policy, policy_state_dict
from tests.broadcaster.lora_policies import lora_policy


def test_sigma_trend_by_hand():
    # K = 4 stages: stage 0 clean, stages 1..3 = 5e-2 * (5e-4 / 5e-2)^(j-1)/2 = 5e-2, 5e-3, 5e-4
    assert qerl_sigma_trend(5e-2, 5e-4, 4) == pytest.approx([5e-2, 5e-3, 5e-4], rel=1e-12)
    # K = 3: the two noisy stages are exactly the endpoints
    assert qerl_sigma_trend(1e-2, 1e-4, 3) == pytest.approx([1e-2, 1e-4], rel=1e-12)
    # K = 2: one noisy stage at sigma_start
    assert qerl_sigma_trend(1e-2, 1e-4, 2) == [1e-2]
    # K = 10, sigma 1e-2 -> 1e-4 over 9 noisy stages: ratio (1e-2)^(1/8) per stage
    trend = qerl_sigma_trend(1e-2, 1e-4, 10)
    assert len(trend) == 9 and trend[0] == pytest.approx(1e-2) and trend[-1] == pytest.approx(1e-4)
    assert trend[4] == pytest.approx(1e-3)  # halfway in log space
    assert all(b / a == pytest.approx(10 ** (-2 / 8)) for a, b in zip(trend, trend[1:]))


def test_stages_split_training_evenly_and_the_first_is_clean():
    # 10 steps, 5 stages of 2 steps: 0,1 -> 0; 2,3 -> 1; ...; 8,9 -> 4; step 10 (the last version) stays in 4
    assert [qerl_noise_stage(s, 10, 5) for s in range(11)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4]
    # uneven: 7 steps, 3 stages -> floor(3s/7): 0,0,0,1,1,2,2, then clamped
    assert [qerl_noise_stage(s, 7, 3) for s in range(8)] == [0, 0, 0, 1, 1, 2, 2, 2]
    sigmas = [qerl_noise_sigma(s, 10, sigma_start=5e-2, sigma_end=5e-4, num_stages=5) for s in range(11)]
    ratio = (5e-4 / 5e-2) ** (1 / 3)
    assert sigmas[:2] == [0.0, 0.0]
    assert sigmas[2:] == pytest.approx([5e-2] * 2 + [5e-2 * ratio] * 2 + [5e-2 * ratio**2] * 2 + [5e-4] * 3, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [dict(sigma_start=0.0, sigma_end=1e-3, num_stages=3), dict(sigma_start=1e-2, sigma_end=1e-3, num_stages=1)],
)
def test_schedule_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        qerl_noise_sigma(1, 10, **kwargs)
    with pytest.raises(ValueError, match="total_steps"):
        qerl_noise_stage(0, 0, 3)


def test_config_says_the_fix():
    with pytest.raises(ValueError, match="swap"):
        NoiseSchedulerConfig(enabled=True, sigma_start=1e-4, sigma_end=1e-2)


@pytest.mark.parametrize(
    "name,noised",
    [
        ("model.layers.0.input_layernorm.weight", True),
        ("model.layers.11.post_attention_layernorm.weight", True),
        ("model.norm.weight", True),
        ("model.layers.0.self_attn.q_norm.weight", False),  # Qwen3 per-head norms: not in QeRL's scheme
        ("model.layers.0.self_attn.k_norm.weight", False),
        ("model.layers.0.mlp.up_proj.weight", False),
        ("lm_head.weight", False),
        ("model.norm.bias", False),
    ],
)
def test_rmsnorm_selection(name, noised):
    assert is_rmsnorm_weight(name) is noised


def test_noisy_copy_leaves_the_source_clean(tiny_policy):
    model = load_policy(str(tiny_policy), LoraSection())
    state = policy_state_dict(model)
    before = {n: t.clone() for n, t in state.items()}
    sigma = 0.05
    noisy = with_rmsnorm_noise(state, sigma, seed=3, version=7)
    norms = [n for n in state if is_rmsnorm_weight(n)]
    assert len(norms) == 5
    for name, tensor in state.items():
        assert torch.equal(tensor, before[name]), name  # nothing modified in place
        assert torch.equal(model.state_dict()[name], before[name])
        if name in norms:
            assert noisy[name] is not tensor and not torch.equal(noisy[name], tensor)
        else:
            assert noisy[name] is tensor  # shared, not copied
    deltas = torch.cat([(noisy[n] - state[n]).flatten() for n in norms])  # 5 x 64 draws
    assert deltas.mean().abs() < 4 * sigma / math.sqrt(deltas.numel())
    assert 0.85 * sigma < deltas.std() < 1.15 * sigma
    again = with_rmsnorm_noise(state, sigma, seed=3, version=7)
    other = with_rmsnorm_noise(state, sigma, seed=3, version=8)
    assert all(torch.equal(again[n], noisy[n]) for n in norms)
    assert not any(torch.equal(other[n], noisy[n]) for n in norms)
    assert with_rmsnorm_noise(state, 0.0, seed=3, version=7) == state
    with pytest.raises(ValueError, match="sigma"):
        with_rmsnorm_noise(state, -1.0, seed=0, version=1)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_trainer_sends_noisy_norms_and_keeps_clean_ones(tiny_policy, tmp_path, lora):
    """trainer.publish.weights_payload (the trainer's own code): in a noisy stage the norms it sends
    carry noise, in stage 0 none, its model stays clean; with LoRA the norms travel whole beside
    the adapter and equal the noisy norms of the merged (filesystem) payload."""
    from trainer.proc import TrainerProc
    from trainer.publish import weights_payload

    cfg = RunConfig(run_dir=str(tmp_path))
    cfg.trainer = cfg.trainer.model_copy(update={"max_steps": 10})
    cfg.broadcast = cfg.broadcast.model_copy(
        update={"noise_scheduler": NoiseSchedulerConfig(enabled=True, sigma_start=5e-2, sigma_end=5e-4, num_stages=5)}
    )
    proc = TrainerProc(cfg, "trainer", 0)
    try:
        proc.model = lora_policy(tiny_policy) if lora else load_policy(str(tiny_policy), LoraSection())
        clean = {n: t.clone() for n, t in proc.model.state_dict().items()}
        merged_clean = policy_state_dict(proc.model)
        norms = [n for n in merged_clean if is_rmsnorm_weight(n)]
        stage0 = weights_payload(proc.model, cfg, 1, adapter=lora)  # stage 0 of 5 over 10 steps: clean
        noisy = weights_payload(proc.model, cfg, 4, adapter=lora)  # stage 2: sigma = 5e-2 * (1e-2)^(1/3)
        sigma = 5e-2 * (1e-2) ** (1 / 3)
        merged_noisy = weights_payload(proc.model, cfg, 4, adapter=False)
        for n in norms:
            assert torch.equal(stage0[n], merged_clean[n])
            delta = noisy[n] - merged_clean[n]
            assert 0 < delta.abs().max() < 6 * sigma
            assert torch.equal(noisy[n], merged_noisy[n])  # broadcast and filesystem agree
        for n, t in proc.model.state_dict().items():
            assert torch.equal(t, clean[n]), n
        if lora:
            assert any(n.endswith(".lora_A.weight") for n in noisy)
            assert not any(n.endswith("q_proj.weight") for n in noisy)
    finally:
        proc.close()
