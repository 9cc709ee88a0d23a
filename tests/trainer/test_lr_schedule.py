"""The learning-rate schedule of ``trainer.optim`` (trainer/optim/lr_schedule.py): the factor
against hand-computed values, the torch scheduler against transformers' own schedule, the ``lr``
of every step's metrics, and a resume through the real checkpoint code that trains the next step
with the uninterrupted run's learning rate."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup_lr_rate

from configs.schema import OptimConfig, TrainerConfig
from tests.trainer.test_checkpoint import policy, step_batches, weights
from trainer.optim.lr_schedule import build_lr_scheduler, lr_factor, rebind_lr_scheduler
from trainer.dp_follower import load_trainer_checkpoint
from trainer.state.checkpoint import load_checkpoint, save_checkpoint, snapshot_state
from trainer.trainer import Trainer

PEAK = 1e-3


def factors(schedule: str, warmup: int, total: int, min_ratio: float) -> list[float]:
    return [
        lr_factor(s, schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio)
        for s in range(total)
    ]


def test_factors_match_hand_computed_values():
    # warm-up 2 of 6 steps: (s + 1) / 2; decay progress p = (s - 1) / 4 for s >= 2
    assert factors("constant", 2, 6, 0.1) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert factors("linear", 2, 6, 0.1) == pytest.approx([0.5, 1.0, 0.775, 0.55, 0.325, 0.1], abs=1e-12)
    c = 0.5 * (1 + math.cos(math.pi / 4))  # p = 1/4: 0.853553...
    assert factors("cosine", 2, 6, 0.1) == pytest.approx(
        [0.5, 1.0, 0.1 + 0.9 * c, 0.55, 0.1 + 0.9 * (1 - c), 0.1], abs=1e-12
    )
    assert factors("cosine", 0, 4, 0.0) == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0)], abs=1e-12
    )
    assert factors("constant", 0, 3, 0.5) == [1.0, 1.0, 1.0]
    assert factors("linear", 3, 3, 0.0) == pytest.approx([1 / 3, 2 / 3, 1.0])  # all warm-up
    # past the last step the rate stays at the minimum
    assert lr_factor(9, schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.1) == pytest.approx(0.1)


@pytest.mark.parametrize(("warmup", "total", "min_ratio"), [(0, 7, 0.0), (3, 10, 0.1), (5, 5, 0.2)])
def test_cosine_scheduler_follows_transformers(warmup, total, min_ratio):
    """The torch LambdaLR the trainer steps gives the same rates as transformers' cosine schedule
    with a minimum rate (the formula's source) over the whole run."""
    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)
    sched = build_lr_scheduler(
        ours, OptimConfig(lr=PEAK, scheduler="cosine", warmup_steps=warmup, min_lr_ratio=min_ratio), total
    )
    ref = get_cosine_with_min_lr_schedule_with_warmup_lr_rate(theirs, warmup, total, min_lr_rate=min_ratio)
    for _ in range(total):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-12, abs=1e-18)
        ours.step(), theirs.step(), sched.step(), ref.step()


def test_bad_schedule_arguments_are_named():
    with pytest.raises(ValueError, match="schedule must be one of"):
        lr_factor(0, schedule="step", warmup_steps=0, total_steps=3, min_lr_ratio=0.0)
    with pytest.raises(ValueError, match="warmup_steps=4"):
        lr_factor(0, schedule="linear", warmup_steps=4, total_steps=3, min_lr_ratio=0.0)
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        lr_factor(0, schedule="linear", warmup_steps=0, total_steps=3, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="trainer.optim.warmup_steps"):
        TrainerConfig(max_steps=3, optim=OptimConfig(warmup_steps=4))
    with pytest.raises(ValueError, match="scheduler"):
        OptimConfig(scheduler="exponential")


def test_rebinding_to_a_rebuilt_optimizer_keeps_step_and_rate():
    cfg = OptimConfig(lr=PEAK, scheduler="linear", warmup_steps=1, min_lr_ratio=0.0)
    first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)
    sched = build_lr_scheduler(first, cfg, 5)
    for _ in range(3):
        first.step(), sched.step()
    rebuilt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)
    rebound = rebind_lr_scheduler(sched, rebuilt, cfg, 5)
    # warm-up 1 of 5 steps, then p = s / 4: step 3 trains with 1 - 3/4, step 4 with 0
    assert rebound.last_epoch == 3 and rebuilt.param_groups[0]["lr"] == pytest.approx(PEAK * 1 / 4)
    rebuilt.step(), rebound.step()
    assert rebuilt.param_groups[0]["lr"] == 0.0


SCHEDULED = TrainerConfig(max_steps=5, optim=OptimConfig(lr=PEAK, scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1))


def expected_lr(step: int) -> float:
    return PEAK * lr_factor(step, schedule="cosine", warmup_steps=2, total_steps=5, min_lr_ratio=0.1)


@pytest.mark.parametrize("background", [False, True], ids=["now", "snapshot"])
def test_resume_trains_the_next_step_with_the_uninterrupted_runs_rate(model_dir, tmp_path, background):
    """Save after k = 3 steps (the checkpoint code the trainer process uses, with the scheduler),
    restore into a fresh model, optimizer and scheduler: step k trains with the rate the
    uninterrupted run used there, and the weights after it match bit for bit."""
    k = 3
    model = policy(model_dir, lora=False)
    batches = step_batches(model, k + 1)
    trainer = Trainer(model, SCHEDULED)
    lrs = [trainer.step(mbs)["lr"] for mbs in batches[:k]]
    assert lrs == pytest.approx([expected_lr(s) for s in range(k)], rel=1e-12)
    state = snapshot_state(model, trainer.optimizer, trainer.scheduler) if background else None
    path = save_checkpoint(
        tmp_path, step=k, model=model, optimizer=trainer.optimizer, extra={}, scheduler=trainer.scheduler, state=state
    )
    assert (path / "scheduler.pt").is_file()
    uninterrupted = trainer.step(batches[k])["lr"]
    reference = weights(model)

    fresh = policy(model_dir, lora=False)
    resumed = Trainer(fresh, SCHEDULED)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr(0))  # before the load: step 0's
    assert load_checkpoint(path, model=fresh, optimizer=resumed.optimizer, scheduler=resumed.scheduler) == {"step": k}
    assert resumed.scheduler.last_epoch == k
    after_resume = resumed.step(batches[k])["lr"]
    assert after_resume == uninterrupted == pytest.approx(expected_lr(k), rel=1e-12)
    assert expected_lr(k) not in (PEAK, expected_lr(0))  # a schedule that did not resume would differ
    after = weights(fresh)
    assert all(torch.equal(after[n], reference[n]) for n in reference)


def test_a_checkpoint_without_scheduler_state_resumes_at_its_steps_rate(model_dir, tmp_path):
    """A checkpoint written before the trainer saved its schedule (no scheduler.pt): the trainer
    process's loader puts the schedule at the checkpoint's step."""
    model = policy(model_dir, lora=False)
    trainer = Trainer(model, SCHEDULED)
    for mbs in step_batches(model, 2):
        trainer.step(mbs)
    path = save_checkpoint(tmp_path, step=2, model=model, optimizer=trainer.optimizer, extra={})
    assert not (path / "scheduler.pt").exists()
    fresh = policy(model_dir, lora=False)
    resumed = Trainer(fresh, SCHEDULED)
    assert load_trainer_checkpoint(path, resumed) == {"step": 2}
    assert resumed.scheduler.last_epoch == 2
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr(2), rel=1e-12)


CHANGED = TrainerConfig(
    max_steps=6, optim=OptimConfig(lr=PEAK / 4, scheduler="linear", warmup_steps=1, min_lr_ratio=0.2)
)


def changed_lr(step: int) -> float:
    return PEAK / 4 * lr_factor(step, schedule="linear", warmup_steps=1, total_steps=6, min_lr_ratio=0.2)


def test_resume_follows_the_configs_schedule_from_the_checkpoint_step(model_dir, tmp_path, caplog):
    """``busctl up --resume`` with a changed ``trainer.optim`` (and ``max_steps``): the trainer
    process's loader keeps the step and AdamW's moments but trains every later step with the new
    config's rate, and says so in one warning; with the config unchanged the same loader resumes
    bit for bit (weights and optimizer state) and warns nothing."""
    k = 3
    model = policy(model_dir, lora=False)
    batches = step_batches(model, k + 2)
    trainer = Trainer(model, SCHEDULED)
    for mbs in batches[:k]:
        trainer.step(mbs)
    path = save_checkpoint(
        tmp_path,
        step=k,
        model=model,
        optimizer=trainer.optimizer,
        extra={"lr_schedule": "cosine"},
        scheduler=trainer.scheduler,
    )
    uninterrupted = [trainer.step(mbs)["lr"] for mbs in batches[k:]]
    reference, reference_opt = weights(model), trainer.optimizer.state_dict()

    # unchanged config: bit-identical, silent
    same = Trainer(policy(model_dir, lora=False), SCHEDULED)
    with caplog.at_level("WARNING", logger="trainer.dp_follower"):
        assert load_trainer_checkpoint(path, same) == {"step": k, "lr_schedule": "cosine"}
    assert not caplog.records
    assert [same.step(mbs)["lr"] for mbs in batches[k:]] == uninterrupted
    after = weights(same.model)
    assert all(torch.equal(after[n], reference[n]) for n in reference)
    assert same.optimizer.state_dict()["param_groups"] == reference_opt["param_groups"]

    # changed lr, scheduler, warm-up, min ratio and max_steps: the new schedule from step k on
    changed = Trainer(policy(model_dir, lora=False), CHANGED)
    with caplog.at_level("WARNING", logger="trainer.dp_follower"):
        load_trainer_checkpoint(path, changed)
    (record,) = caplog.records
    message = record.getMessage()
    assert f"step {k}: {expected_lr(k):.4g} -> {changed_lr(k):.4g}" in message
    assert f"trainer.optim.lr {PEAK:.4g} -> {PEAK / 4:.4g}" in message and "scheduler cosine -> linear" in message
    assert changed.scheduler.get_last_lr() == [changed_lr(k)] and changed.scheduler.base_lrs == [PEAK / 4]
    saved = torch.load(path / "optimizer.pt", weights_only=True)["state"]  # AdamW's step counts and moments
    loaded = changed.optimizer.state_dict()["state"]
    assert loaded.keys() == saved.keys() and saved, "the loader did not keep the checkpoint's optimizer state"
    for index, moments in saved.items():
        for name, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded[index][name]), torch.as_tensor(value)), (index, name)
    lrs = [changed.step(mbs)["lr"] for mbs in batches[k:]]
    assert lrs == pytest.approx([changed_lr(k), changed_lr(k + 1)], rel=1e-12)
    assert lrs != pytest.approx(uninterrupted, rel=1e-3)  # the checkpoint's schedule would have given these
    assert changed.optimizer.param_groups[0]["initial_lr"] == PEAK / 4
    moved = weights(changed.model)
    assert any(not torch.equal(moved[n], reference[n]) for n in reference)
