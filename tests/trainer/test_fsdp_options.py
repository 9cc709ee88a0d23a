"""One-process pieces of trainer/parallel/sharding.py: activation checkpointing leaves the update
unchanged, LoRA is refused for fsdp, and a checkpoint loads only into a trainer sharded as the
run that wrote it (the 2-rank runs are in test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from configs.schema import LoraSection, TrainerConfig
from tests.trainer.test_data_parallel import make_micro_batches, trainable, trainer_cfg
from trainer.state.checkpoint import load_checkpoint, save_checkpoint, snapshot_state
from trainer.state.model import load_policy
from trainer.forward.packed import PackedLogprobs
from trainer.parallel.sharding import SHARDED_DIR, shard_policy
from trainer.trainer import Trainer


def test_activation_checkpointing_gives_the_same_steps(model_dir):
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = load_policy(model_dir, LoraSection())
        cfg = TrainerConfig(**{**trainer_cfg().model_dump(), "activation_checkpointing": checkpointing})
        trainer = Trainer(model, cfg)
        assert model.is_gradient_checkpointing == checkpointing
        metrics = [trainer.step(make_micro_batches(model, s)) for s in range(2)]
        runs.append((metrics, trainable(model)))
    (m0, w0), (m1, w1) = runs
    # the recomputed forward runs the same CPU kernels on the same inputs: the same numbers
    for a, b in zip(m0, m1):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_fsdp_refuses_lora(model_dir):
    model = load_policy(model_dir, LoraSection(enabled=True, rank=4, alpha=8.0))
    with pytest.raises(ValueError, match="lora"):
        shard_policy(PackedLogprobs(model), torch.device("cpu"), 2, bfloat16=False)


def test_a_checkpoint_loads_only_into_a_trainer_sharded_like_its_writer(model_dir, tmp_path):
    model = load_policy(model_dir, LoraSection())
    trainer = Trainer(model, trainer_cfg())
    one_file = save_checkpoint(tmp_path / "a", step=1, model=model, optimizer=trainer.optimizer, extra={})
    with pytest.raises(ValueError, match="trainer.parallel"):
        load_checkpoint(one_file, model=model, optimizer=trainer.optimizer, read_state=lambda path: None)

    written = []
    sharded = save_checkpoint(
        tmp_path / "b",
        step=1,
        model=model,
        optimizer=trainer.optimizer,
        extra={},
        write_state=lambda tmp: written.append((tmp / SHARDED_DIR).mkdir()),
    )
    assert written and (sharded / SHARDED_DIR).is_dir() and not (sharded / "optimizer.pt").exists()
    with pytest.raises(ValueError, match="trainer.parallel"):
        load_checkpoint(sharded, model=model, optimizer=trainer.optimizer)
    read = []
    assert load_checkpoint(sharded, model=model, optimizer=trainer.optimizer, read_state=read.append) == {"step": 1}
    assert read == [sharded]
    with pytest.raises(ValueError, match="write_state"):  # a sharded save takes the live state, no snapshot
        save_checkpoint(
            tmp_path / "c",
            step=1,
            model=model,
            optimizer=trainer.optimizer,
            extra={},
            write_state=lambda tmp: None,
            state=snapshot_state(model, trainer.optimizer),
        )
    # the LR scheduler's state (the same on every rank) is saved beside the shards and restored
    trainer.optimizer.step(), trainer.scheduler.step()  # no gradients: AdamW leaves the weights alone
    with_scheduler = save_checkpoint(
        tmp_path / "d",
        step=1,
        model=model,
        optimizer=trainer.optimizer,
        extra={},
        scheduler=trainer.scheduler,
        write_state=lambda tmp: None,
    )
    fresh = Trainer(model, trainer_cfg())
    load_checkpoint(
        with_scheduler, model=model, optimizer=fresh.optimizer, scheduler=fresh.scheduler, read_state=lambda path: None
    )
    assert fresh.scheduler.last_epoch == trainer.scheduler.last_epoch == 1
