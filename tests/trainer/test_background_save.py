"""A checkpoint written on a background thread from a snapshot (:func:`trainer.state.checkpoint.snapshot_state`,
:class:`trainer.state.background_save.BackgroundSave`) while the trainer goes on training holds exactly
the state of the snapshot's moment (the same files as a save at that moment), for full
fine-tuning and LoRA; the background save hands each result back once and re-raises failures."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_checkpoint import CFG, assert_same_optimizer_state, policy, step_batches
from trainer.state.background_save import BackgroundSave
from trainer.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, snapshot_state
from trainer.trainer import Trainer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_background_save_writes_the_state_of_its_snapshot(model_dir, tmp_path, lora):
    model = policy(model_dir, lora)
    trainer = Trainer(model, CFG)
    batches = step_batches(model, 3)
    trainer.step(batches[0])
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    now = save_checkpoint(tmp_path / "now", step=1, model=model, optimizer=trainer.optimizer, extra={"k": 1})
    state = snapshot_state(model, trainer.optimizer)
    saving = BackgroundSave()
    release = threading.Event()

    def write():
        release.wait(60)  # written only after the trainer changed weights, optimizer and RNG
        return save_checkpoint(
            tmp_path / "later", step=1, model=model, optimizer=trainer.optimizer, extra={"k": 1}, state=state
        )

    saving.start(1, write)
    assert saving.in_flight == 1 and saving.finished() is None
    with pytest.raises(ValueError, match="still in flight"):
        saving.start(2, write)
    trainer.step(batches[1])
    torch.rand(3)
    release.set()
    step, later = saving.wait()
    assert step == 1 and later == latest_checkpoint(tmp_path / "later")
    assert saving.wait() is None and saving.finished() is None and saving.in_flight is None  # handed back once
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = load_file(now / weights), load_file(later / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_optimizer_state(
        torch.load(now / "optimizer.pt", weights_only=True), torch.load(later / "optimizer.pt", weights_only=True)
    )
    assert (now / "rng.json").read_text() == (later / "rng.json").read_text()
    assert (now / "meta.json").read_text() == (later / "meta.json").read_text()
    # and it resumes like the checkpoint taken at that moment: the same next step
    resumed = [policy(model_dir, lora), policy(model_dir, lora)]
    out = []
    for m, path in zip(resumed, (now, later)):
        t = Trainer(m, CFG)
        assert load_checkpoint(path, model=m, optimizer=t.optimizer)["step"] == 1
        t.step(batches[1])
        out.append({n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad})
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])


def test_the_snapshot_keeps_tied_weights_tied_and_frozen_weights_uncopied(model_dir):
    model = policy(model_dir, lora=True)
    state = snapshot_state(model, Trainer(model, CFG).optimizer)
    live = model.state_dict()
    for name, tensor in state.model_state.items():
        copied = tensor.data_ptr() != live[name].data_ptr()
        assert copied == ("lora_" in name), name  # only the trainable adapter is copied
    full = policy(model_dir, lora=False)
    full.lm_head.weight = full.model.embed_tokens.weight  # tie them
    snap = snapshot_state(full, Trainer(full, CFG).optimizer).model_state
    assert snap["lm_head.weight"] is snap["model.embed_tokens.weight"]
    assert snap["lm_head.weight"].data_ptr() != full.lm_head.weight.data_ptr()


def test_a_failed_background_save_raises_on_the_callers_thread():
    saving = BackgroundSave()

    def fail():
        raise OSError("disk full")

    saving.start(3, fail)
    with pytest.raises(OSError, match="disk full"):
        saving.wait()
    assert saving.in_flight is None
    saving.start(4, fail)
    while (done := saving.in_flight) is not None:
        try:
            saving.finished()
        except OSError:
            break
    assert done == 4 and saving.in_flight is None
