"""The data-parallel ranks > 0 (``trainer.data_parallel > 1``, under torchrun), and the checkpoint
and group helpers rank 0 shares. A follower opens no bus socket, writes no checkpoint and sends no
weights: it builds the trainer like rank 0, loads the checkpoint rank 0 names, then trains each
share rank 0 sends and joins the gathers and sharded saves it announces until ``stop``
(:mod:`trainer.parallel.distributed`). It dies with the torchrun agent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lifecycle.parent_death import die_with_parent
from configs.schema import RunConfig, load_config
from trainer.optim.lr_schedule import ResumedRate, set_lr_schedule_step
from trainer.state.checkpoint import has_scheduler_state, load_checkpoint
from trainer.parallel.distributed import GATHER, SAVE, STEP, DataParallel
from trainer.state.model import load_policy
from trainer.parallel.device import trainer_device
from trainer.parallel.sharding import SHARDED_DIR, full_entry, is_sharded, load_sharded, save_sharded, weight_entries
from trainer.trainer import Trainer, build_trainer

log = logging.getLogger(__name__)

__all__ = ["checkpoint_writer", "follow", "follower_main", "join_data_parallel", "load_trainer_checkpoint", "serve"]


def join_data_parallel(cfg: RunConfig) -> DataParallel | None:
    """Join the trainer's group when ``trainer.data_parallel > 1`` (errors: :meth:`DataParallel.from_env`);
    None with one rank."""
    t = cfg.trainer
    if t.data_parallel == 1:
        return None
    return DataParallel.from_env(t.dp_backend, t.dp_timeout_s, world_size=t.data_parallel)


def load_trainer_checkpoint(path: Path, trainer: Trainer) -> dict:
    """Restore ``trainer``'s model, optimizer, LR schedule and RNG from checkpoint ``path`` (every
    rank alike; a sharded trainer reads ``sharded/``, a collective); returns its state. The learning
    rate follows the config from the checkpoint's step on (:func:`set_lr_schedule_step`), with one
    warning when it differs from the saving run's."""
    model, optimizer = trainer.model, trainer.optimizer
    read = (lambda p: load_sharded(model, optimizer, p / SHARDED_DIR)) if is_sharded(model) else None
    saved = has_scheduler_state(path)
    state = load_checkpoint(
        path, model=model, optimizer=optimizer, scheduler=trainer.scheduler if saved else None, read_state=read
    )
    step, optim = state["step"], trainer.cfg.optim
    checkpoint_lr = float(optimizer.param_groups[0]["lr"])  # the saving run's rate for `step`
    checkpoint_peak = float(trainer.scheduler.base_lrs[0]) if saved else checkpoint_lr
    config_lr = set_lr_schedule_step(trainer.scheduler, optim.lr, step)[0]
    rate = ResumedRate(step, checkpoint_peak, optim.lr, checkpoint_lr, config_lr)
    old_schedule = state.get("lr_schedule", optim.scheduler)
    if rate.changed or old_schedule != optim.scheduler:
        log.warning(
            "learning rate from the config on resume at step %d: %.4g -> %.4g (trainer.optim.lr %.4g -> %.4g, "
            "scheduler %s -> %s); the checkpoint's optimizer moments are kept",
            step,
            checkpoint_lr,
            config_lr,
            checkpoint_peak,
            optim.lr,
            old_schedule,
            optim.scheduler,
        )
    return state


def checkpoint_writer(trainer: Trainer) -> Callable[[Path], None] | None:
    """Rank 0's ``write_state`` for a sharded (fsdp) trainer: tell the followers to write their
    shards (SAVE), then write its own; None for one rank or DDP."""
    dp, model = trainer.dp, trainer.model
    if dp is None or not is_sharded(model):
        return None

    def write(directory: Path) -> None:
        dp.send_save(str(directory / SHARDED_DIR))
        save_sharded(model, trainer.optimizer, directory / SHARDED_DIR)

    return write


def follow(cfg: RunConfig, dp: DataParallel) -> Trainer:
    """A rank > 0: build the policy and :class:`Trainer` like rank 0, load the checkpoint rank 0
    names (or none), join the group and :func:`serve` until ``stop``; returns the trainer."""
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    model = load_policy(cfg.model.path, cfg.trainer.lora).to(trainer_device(cfg, dp))
    trainer = build_trainer(model, cfg)
    fsdp = cfg.trainer.parallel == "fsdp"
    if fsdp:  # shard first: a sharded checkpoint loads into the shards
        trainer.enable_data_parallel(dp)
    checkpoint = dp.recv_text()
    if checkpoint:
        load_trainer_checkpoint(Path(checkpoint), trainer)
        log.info("rank %d resumed from %s", dp.rank, checkpoint)
    if not fsdp:
        trainer.enable_data_parallel(dp)
    serve(trainer, dp)
    return trainer


def serve(trainer: Trainer, dp: DataParallel) -> int:
    """A follower's loop once ``trainer`` is in ``dp``: train each share, join the gathers and
    sharded saves, until ``stop``; returns the steps trained (ValueError out of protocol)."""
    entries = weight_entries(trainer.model) if is_sharded(trainer.model) else []
    steps = 0
    while True:
        kind, value = dp.recv_command()
        if kind == STEP:
            trainer.step(value)  # the metrics are rank 0's to report (reduced over every rank there)
            steps += 1
        elif kind == GATHER:  # rank 0 publishes this weight: join its all-gather, drop the result
            full_entry(entries[value][1])
        elif kind == SAVE:
            save_sharded(trainer.model, trainer.optimizer, Path(value))
        else:  # STOP
            break
    log.info("rank %d: stopped by rank 0 after %d steps", dp.rank, steps)
    trainer.disable_data_parallel()  # before the group goes (see Trainer.disable_data_parallel)
    return steps


def follower_main(argv: list[str] | None = None) -> int:
    """Entry of a rank > 0 (``RANK`` set by torchrun); returns 0 once rank 0 sent ``stop``. On an
    exception it logs it and exits at once with code 1 (no finalizers: a hung rank would keep rank 0
    waiting ``trainer.dp_timeout_s``)."""
    parser = argparse.ArgumentParser(description="rlbus trainer, data-parallel rank > 0")
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    parser.add_argument("--name", default="trainer", help="component name")
    args, _ = parser.parse_known_args(argv)  # --index / --metrics-port are rank 0's
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s {args.name}[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    die_with_parent(signal.SIGTERM)
    dp = None
    try:
        cfg = load_config(Path(args.run_dir) / "config.yaml")
        dp = join_data_parallel(cfg)
        if dp is None:
            raise ValueError(f"RANK={rank} but trainer.data_parallel is 1; launch one trainer process")
        follow(cfg, dp)
    except Exception:
        # exit at once, without finalizers: a rank hung at exit would keep rank 0 waiting in its
        # next collective for trainer.dp_timeout_s, while a dead one makes torchrun end the group
        log.exception("%s rank %s failed", args.name, rank)
        logging.shutdown()
        os._exit(1)
    dp.close()
    return 0
