"""Tests for trainer.state.checkpoint: RNG and LR-scheduler states round-trip, incomplete checkpoints
are ignored, old ones are pruned, mismatches are refused. The bit-exact resume of training (full
fine-tuning and LoRA) is in test_resume.py, with the helpers here (``policy``, ``step_batches``).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from configs.schema import LoraSection, OptimConfig, TrainerConfig
from tests.scored_groups import packed_step, scored
from trainer.state.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.state.model import load_policy
from trainer.forward.packed import packed_token_logprobs
from trainer.trainer import build_optimizer

# (prompt tokens, completion tokens, advantage, reward)
SPECS = [
    ([1, 2, 3], [40, 41, 42, 43], 1.0, 1.0),
    ([4, 5], [60, 61, 62], -1.0, 0.0),
    ([7, 8, 9, 10], [80, 81], 0.5, 0.75),
    ([11], [100, 101, 102, 103, 104], -0.5, 0.25),
]
CFG = TrainerConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=1.0))


def policy(model_dir: str, lora: bool) -> torch.nn.Module:
    torch.manual_seed(1)  # peft's lora_A init; overwritten by a load anyway
    return load_policy(model_dir, LoraSection(enabled=lora, rank=4, alpha=8.0, dropout=0.3 if lora else 0.0))


def step_batches(model: torch.nn.Module, num_steps: int):
    """Micro-batches of ``num_steps`` steps (a different split and sign per step), with the
    initial model's logprobs as sampler logprobs."""
    groups = []
    with torch.no_grad():
        for k, (prompt, comp, adv, rew) in enumerate(SPECS):
            ids = prompt + comp
            lp = packed_token_logprobs(model, torch.tensor(ids), torch.tensor([len(ids)]), temperature=1.0)
            groups.append(
                scored(f"g{k}", prompt, [comp], advantages=[adv], rewards=[rew], logprobs=[lp.numpy()[len(prompt) :]])
            )
    splits = [[[0, 1], [2, 3]], [[3], [0, 2, 1]], [[1, 2, 3, 0]], [[2], [1], [0, 3]], [[0, 3], [1, 2]]]
    out = []
    for step in range(num_steps):
        sign = 1.0 if step % 2 == 0 else -0.5
        signed = [dataclasses.replace(g, advantages=sign * g.advantages) for g in groups]
        out.append(packed_step(signed, splits[step % len(splits)], step=step))
    return out


def weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k in a["state"]:
        for name, value in a["state"][k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][k][name])), (k, name)


def test_rng_states_are_restored(model_dir, tmp_path):
    model = policy(model_dir, lora=False)
    optimizer = build_optimizer(model, CFG)
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    path = save_checkpoint(tmp_path, step=0, model=model, optimizer=optimizer, extra={})
    draws = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], np.random.randn(3))
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    assert load_checkpoint(path, model=model, optimizer=optimizer) == {"step": 0}
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], np.random.randn(3))
    assert torch.equal(draws[0], again[0])
    assert np.array_equal(draws[1], again[1]) and draws[2] == again[2] and np.array_equal(draws[3], again[3])


def test_lr_scheduler_state_round_trips(model_dir, tmp_path):
    """rlbus trains with a constant LR (no scheduler); a trainer that adds one gets it checkpointed."""

    def build():
        optimizer = build_optimizer(model, CFG)
        return optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)

    model = policy(model_dir, lora=False)
    optimizer, scheduler = build()
    for _ in range(3):
        optimizer.step()  # no gradients: parameters untouched, only the schedule moves
        scheduler.step()
    path = save_checkpoint(tmp_path, step=3, model=model, optimizer=optimizer, extra={}, scheduler=scheduler)
    assert (path / "scheduler.pt").is_file()
    fresh_optimizer, fresh = build()
    load_checkpoint(path, model=model, optimizer=fresh_optimizer, scheduler=fresh)
    assert fresh.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] != CFG.optim.lr * 0.5
    fresh.step(), scheduler.step()
    assert fresh.get_last_lr() == scheduler.get_last_lr()
    with pytest.raises(ValueError, match="has LR scheduler state but none was passed"):
        load_checkpoint(path, model=model, optimizer=fresh_optimizer)
    plain = save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer, extra={})
    assert not (plain / "scheduler.pt").exists()
    with pytest.raises(ValueError, match="has no LR scheduler state but a scheduler was passed"):
        load_checkpoint(plain, model=model, optimizer=fresh_optimizer, scheduler=fresh)


def test_incomplete_checkpoints_are_ignored(model_dir, tmp_path):
    model = policy(model_dir, lora=False)
    optimizer = build_optimizer(model, CFG)
    assert latest_checkpoint(tmp_path / "none") is None and latest_checkpoint(tmp_path) is None
    done = save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer, extra={}, keep=5)
    # a save killed before DONE: all files but the marker, under a final name and under a temp name
    crashed = save_checkpoint(tmp_path / "scratch", step=5, model=model, optimizer=optimizer, extra={})
    (crashed / "DONE").unlink()
    crashed.rename(tmp_path / "step_000005")
    (tmp_path / ".tmp_step_000006.123").mkdir()
    (tmp_path / "step_000007").mkdir()
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == done
    assert list_checkpoints(tmp_path) == [done]
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_000005", model=model, optimizer=optimizer)
    # the next save cleans the leftovers up (one trainer owns the directory) and keeps other files
    save_checkpoint(tmp_path, step=8, model=model, optimizer=optimizer, extra={}, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "scratch", "step_000004", "step_000008"]


def test_only_the_last_checkpoints_are_kept(model_dir, tmp_path):
    model = policy(model_dir, lora=True)
    optimizer = build_optimizer(model, CFG)
    for step in (1, 2, 3, 10, 11):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=optimizer, extra={"v": step}, keep=2)
        assert len(list_checkpoints(tmp_path)) == min(2, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000011"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010", "step_000011"]
    # saving an existing step again replaces it
    again = save_checkpoint(tmp_path, step=11, model=model, optimizer=optimizer, extra={"v": -1}, keep=2)
    assert load_checkpoint(again, model=model, optimizer=optimizer) == {"step": 11, "v": -1}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000011"]


def test_mismatches_and_bad_arguments_are_refused(model_dir, tmp_path):
    full, lora = policy(model_dir, lora=False), policy(model_dir, lora=True)
    full_opt, lora_opt = build_optimizer(full, CFG), build_optimizer(lora, CFG)
    path = save_checkpoint(tmp_path, step=1, model=lora, optimizer=lora_opt, extra={})
    with pytest.raises(ValueError, match="lora checkpoint but the model is full"):
        load_checkpoint(path, model=full, optimizer=full_opt)
    for bad in ({"step": 3}, {"x": object()}, {"x": float("nan")}):
        with pytest.raises(ValueError):
            save_checkpoint(tmp_path, step=2, model=full, optimizer=full_opt, extra=bad)
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, step=-1, model=full, optimizer=full_opt, extra={})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, step=2, model=full, optimizer=full_opt, extra={}, keep=0)
    assert list_checkpoints(tmp_path) == [path]


def test_tied_embeddings_round_trip(tmp_path):
    """save_pretrained leaves out lm_head when it is tied to embed_tokens; loading must accept that."""
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    a = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        a.model.embed_tokens.weight.add_(1.0)
    path = save_checkpoint(tmp_path, step=0, model=a, optimizer=build_optimizer(a, CFG), extra={})
    torch.manual_seed(1)
    b = Qwen2ForCausalLM(cfg)
    load_checkpoint(path, model=b, optimizer=build_optimizer(b, CFG))
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()
    for n, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[n]), n
