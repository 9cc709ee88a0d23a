"""The learning-rate schedule of ``trainer.optim`` (``scheduler``, ``warmup_steps``,
``min_lr_ratio``) as a torch ``LambdaLR``.

Step ``s`` (0-based: the optimizer step that produces policy version ``s + 1``) trains with
``lr * lr_factor(s)``. The trainer steps the scheduler once after every optimizer step, skipped
ones included (:mod:`trainer.trainer`), so the factor is a function of the step alone, like the
policy version: a resumed trainer (its scheduler state restored from ``scheduler.pt``,
:mod:`trainer.state.checkpoint`) trains step ``k`` with the learning rate the uninterrupted run
used.

On resume the run's config owns the schedule (:func:`set_lr_schedule_step`): ``scheduler.pt``
gives only the step, and step ``k`` trains with ``cfg.lr * lr_factor(k)`` of the resumed run's
``trainer.optim`` (and ``trainer.max_steps``), so a user who lowers ``trainer.optim.lr`` or changes
the decay for ``busctl up --resume`` gets it from the first resumed step (AdamW's moments are
kept). With an unchanged config this is the rate the uninterrupted run used, bit for bit. The
same choice as prime-rl's fresh scheduler over a resumed step (PR #1095) and composer's
``load_ignore_keys`` for the scheduler; transformers' Trainer and torchtitan restore the saved
rates and need an unchanged config.

Invariants: ``0 <= lr_factor(s) <= 1``; warm-up never trains with a zero learning rate; the last
step (``s = total_steps - 1``) of a decaying schedule trains with exactly ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from configs.training import OptimConfig

__all__ = ["SCHEDULES", "ResumedRate", "build_lr_scheduler", "lr_factor", "rebind_lr_scheduler", "set_lr_schedule_step"]

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


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
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
    """The same schedule, at the same step, over ``optimizer`` (a rebuilt optimizer, e.g. over
    FSDP-sharded parameters): the old scheduler's state is loaded into a new one and every param
    group's ``lr`` is set to the scheduler's current learning rate."""
    rebound = build_lr_scheduler(optimizer, cfg, total_steps)
    rebound.load_state_dict(scheduler.state_dict())
    for group, lr in zip(optimizer.param_groups, rebound.get_last_lr(), strict=True):
        group["lr"] = lr
    return rebound


@dataclasses.dataclass(frozen=True)
class ResumedRate:
    """The learning rate of a resumed trainer's next step, by the checkpoint and by the config.

    Attributes:
        step: 0-based optimizer step the resumed trainer trains next (= the checkpoint's step).
        checkpoint_peak: the peak rate (``trainer.optim.lr``) of the run that wrote the checkpoint.
        config_peak: the peak rate of the resumed run's config.
        checkpoint_lr: the rate the checkpoint's schedule had set for ``step``.
        config_lr: the rate ``step`` trains with now: ``config_peak * lr_factor(step)``.
    """

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
    """Put ``scheduler`` (from :func:`build_lr_scheduler`: its factor function is the config's)
    and its optimizer's param groups at step ``steps_done`` of the config's schedule with peak
    ``peak_lr``, whatever a loaded ``scheduler.pt`` or ``optimizer.pt`` held: every group's
    ``lr`` becomes ``peak_lr * lr_factor(steps_done)`` (torch ``LambdaLR``'s own expression,
    ``base_lr * lmbda(last_epoch)``, so an unchanged config gives the saved rate bit for bit),
    ``initial_lr`` and the scheduler's ``base_lrs`` become ``peak_lr`` and ``last_epoch``
    ``steps_done``; the next ``scheduler.step()`` continues the config's schedule.

    Args:
        scheduler: a ``LambdaLR`` over the trainer's optimizer.
        peak_lr: ``trainer.optim.lr`` of the run, > 0.
        steps_done: optimizer steps already taken (the checkpoint's step), >= 0.

    Returns:
        The learning rate of each param group for step ``steps_done``.

    Raises:
        ValueError: ``steps_done`` < 0 or ``peak_lr`` <= 0.
    """
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
