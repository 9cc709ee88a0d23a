"""The learning-rate schedule of ``trainer.optim`` (``scheduler``, ``warmup_steps``,
``min_lr_ratio``) as a torch ``LambdaLR``.

Step ``s`` (0-based: the optimizer step that produces policy version ``s + 1``) trains with
``lr * lr_factor(s)``. The trainer steps the scheduler once after every optimizer step, skipped
ones included (:mod:`trainer.trainer`), so the factor is a function of the step alone, like the
policy version: a resumed trainer (its scheduler state restored from ``scheduler.pt``,
:mod:`trainer.state.checkpoint`) trains step ``k`` with the learning rate the uninterrupted run
used.

Invariants: ``0 <= lr_factor(s) <= 1``; warm-up never trains with a zero learning rate; the last
step (``s = total_steps - 1``) of a decaying schedule trains with exactly ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math
import re
import warnings

import torch

from configs.training import OptimConfig

__all__ = ["SCHEDULES", "advance_lr_scheduler", "build_lr_scheduler", "lr_factor", "rebind_lr_scheduler"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The factor of the peak learning rate at 0-based optimizer step ``step``.

    Warm-up, ``step < warmup_steps``: ``(step + 1) / warmup_steps``. After it, with decay
    progress ``p = (step - warmup_steps + 1) / max(1, total_steps - warmup_steps)`` (1 at the
    last step) and ``m = min_lr_ratio``:

    - constant: ``1``
    - linear:   ``m + (1 - m) * (1 - p)``
    - cosine:   ``m + (1 - m) * 0.5 * (1 + cos(pi * p))``

    Source: transformers' ``get_cosine_with_min_lr_schedule_with_warmup_lr_rate`` (the ``+ 1``
    step convention, ``min_lr_rate``; transformers/optimization.py) and torchtitan's
    ``linear_warmup_stable_decay`` (components/lr_scheduler.py, linear and cosine decay to
    ``min_lr_factor``). Steps past ``total_steps - 1`` keep ``m`` (``p`` is clamped to 1).

    Args:
        step: 0-based optimizer step, >= 0.
        schedule: one of :data:`SCHEDULES`.
        warmup_steps: warm-up steps, 0 <= warmup_steps <= total_steps.
        total_steps: optimizer steps of the run (``trainer.max_steps``), >= 1.
        min_lr_ratio: factor at the last step of linear and cosine, in [0, 1].

    Returns:
        The factor, a float in [0, 1].

    Raises:
        ValueError: an unknown ``schedule`` or an argument out of range (named in the message).
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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR(optimizer, lr_factor)`` for ``trainer.optim`` over ``total_steps`` steps.

    Built right after the optimizer (each param group's ``lr`` is its peak learning rate then):
    it sets every group's ``lr`` to ``peak * lr_factor(0)``; call ``.step()`` once after each
    optimizer step. Its ``state_dict()`` (``last_epoch`` = steps taken, the peak ``base_lrs``)
    is what ``scheduler.pt`` of a checkpoint holds; the factor function is rebuilt from the
    config, not saved.

    Raises:
        ValueError: ``total_steps`` < 1 or ``cfg.warmup_steps`` > ``total_steps``.
    """
    if total_steps < 1 or cfg.warmup_steps > total_steps:
        raise ValueError(f"need 1 <= total_steps and warmup_steps <= total_steps, got total_steps={total_steps}, "
                         f"warmup_steps={cfg.warmup_steps} (trainer.max_steps, trainer.optim.warmup_steps)")

    def factor(step: int) -> float:
        return lr_factor(step, schedule=cfg.scheduler, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                         min_lr_ratio=cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rebind_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The same schedule, at the same step, over ``optimizer`` (a rebuilt optimizer, e.g. over
    FSDP-sharded parameters): the old scheduler's state is loaded into a new one and every param
    group's ``lr`` is set to the scheduler's current learning rate."""
    rebound = build_lr_scheduler(optimizer, cfg, total_steps)
    rebound.load_state_dict(scheduler.state_dict())
    for group, lr in zip(optimizer.param_groups, rebound.get_last_lr(), strict=True):
        group["lr"] = lr
    return rebound


def advance_lr_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, steps_done: int) -> None:
    """Put ``scheduler`` (and its optimizer's param groups) where it is after ``steps_done``
    optimizer steps: for a checkpoint written without ``scheduler.pt`` (before rlbus saved the
    schedule; those runs trained with a constant rate), whose step alone fixes the rate.

    Raises:
        ValueError: ``steps_done`` < 0.
    """
    if steps_done < 0:
        raise ValueError(f"steps_done must be >= 0, got {steps_done}")
    scheduler.last_epoch = steps_done - 1
    with warnings.catch_warnings():  # torch warns when no optimizer step came first: none is due here
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        scheduler.step()  # computes and sets the rate of step ``steps_done``
