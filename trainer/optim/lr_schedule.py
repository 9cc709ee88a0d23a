"""The learning-rate schedule of ``trainer.optim`` (``scheduler``, ``warmup_steps``, ``min_lr_ratio``)
as a torch ``LambdaLR``: step ``s`` (0-based) trains with ``lr * lr_factor(s)``, a function of the
step alone (the scheduler steps after skipped steps too). On resume the config owns the schedule
(:func:`set_lr_schedule_step`; docs/ARCHITECTURE.md, "Trainer math").
"""

from __future__ import annotations

import dataclasses
import math

import torch

from configs.training import OptimConfig

__all__ = ["SCHEDULES", "ResumedRate", "build_lr_scheduler", "lr_factor", "rebind_lr_scheduler", "set_lr_schedule_step"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The factor in [0, 1] of the peak learning rate at 0-based step ``step`` of ``total_steps``.

    Warm-up, ``step < warmup_steps``: ``(step + 1) / warmup_steps`` (never 0). After it, with
    ``p = min(1, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))`` and
    ``m = min_lr_ratio`` in [0, 1]: constant ``1``; linear ``m + (1 - m) * (1 - p)``; cosine
    ``m + (1 - m) * 0.5 * (1 + cos(pi * p))``, so the last step trains with exactly ``m``. Source:
    transformers' ``get_cosine_with_min_lr_schedule_with_warmup_lr_rate`` (the ``+ 1`` convention)
    and torchtitan's ``linear_warmup_stable_decay``. ValueError for another ``schedule`` than
    :data:`SCHEDULES` or an argument out of range.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < 0 or total_steps < 1 or not 0 <= warmup_steps <= total_steps or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"need step >= 0, total_steps >= 1, 0 <= warmup_steps <= total_steps and 0 <= min_lr_ratio <= 1; got "
            f"step={step}, total_steps={total_steps}, warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR(optimizer, lr_factor)`` for ``trainer.optim`` over ``total_steps``, built right
    after the optimizer; ``.step()`` after each optimizer step; its ``state_dict()`` is
    ``scheduler.pt``. ValueError if ``total_steps`` < 1 or ``warmup_steps`` > ``total_steps``."""
    if total_steps < 1 or cfg.warmup_steps > total_steps:
        raise ValueError(
            f"need 1 <= total_steps and warmup_steps <= total_steps, got total_steps={total_steps}, "
            f"warmup_steps={cfg.warmup_steps} (trainer.max_steps, trainer.optim.warmup_steps)"
        )

    def factor(step: int) -> float:
        return lr_factor(
            step,
            schedule=cfg.scheduler,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rebind_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The same schedule at the same step over a rebuilt ``optimizer`` (e.g. over FSDP-sharded
    parameters), its groups' ``lr`` set to the current rate."""
    rebound = build_lr_scheduler(optimizer, cfg, total_steps)
    rebound.load_state_dict(scheduler.state_dict())
    for group, lr in zip(optimizer.param_groups, rebound.get_last_lr(), strict=True):
        group["lr"] = lr
    return rebound


@dataclasses.dataclass(frozen=True)
class ResumedRate:
    """The rate of a resumed trainer's next ``step``: the peaks of the saving run and of this
    config, the saved schedule's rate for ``step`` and this config's (``config_peak * lr_factor``)."""

    step: int
    checkpoint_peak: float
    config_peak: float
    checkpoint_lr: float
    config_lr: float

    @property
    def changed(self) -> bool:
        """Whether the config changes the peak or the rate of the next step."""
        return self.checkpoint_peak != self.config_peak or self.checkpoint_lr != self.config_lr


def set_lr_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float, steps_done: int) -> list[float]:
    """Put ``scheduler`` and its optimizer's groups at step ``steps_done`` of the config's schedule
    with peak ``peak_lr``, whatever ``scheduler.pt`` or ``optimizer.pt`` held, by LambdaLR's own
    expression (an unchanged config gives the saved rate bit for bit); returns the groups' rates.
    ValueError if ``steps_done`` < 0 or ``peak_lr`` <= 0."""
    if steps_done < 0 or not peak_lr > 0:
        raise ValueError(f"need steps_done >= 0 and peak_lr > 0, got steps_done={steps_done}, peak_lr={peak_lr}")
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [peak_lr] * len(groups)
    scheduler.last_epoch = steps_done
    lrs = [base_lr * lmbda(steps_done) for lmbda, base_lr in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(groups, lrs, strict=True):
        group["initial_lr"], group["lr"] = peak_lr, lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() returns; torch sets it in step()
    return lrs
