"""On a real GPU, a trainer step makes the host wait for the device a fixed number of times.

`torch.cuda.set_sync_debug_mode("warn")` makes torch warn at every operation that synchronizes the
host with the device (``.item()``, ``nonzero``, a blocking host-to-device copy, ...). A
`Trainer.step` in bfloat16 on CUDA (flash varlen attention, the Triton logprob kernel, shared
prefixes on and off) must warn as often with 4 micro-batches as with 1, and at most
`MAX_STEP_SYNCS` times: the micro-batch loop queues all its work without waiting (the CPU check of
the same rule, op by op: tests/trainer/test_host_sync.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from configs.schema import OptimConfig, TrainerConfig
from tests.gpu.test_gpu_trainer_bf16 import tiny_model
from tests.trainer.test_host_sync import grpo_samples, step_batches
from trainer.trainer import Trainer

MAX_STEP_SYNCS = 3
"""The step's reads of the device: the micro-batches' stats and the gradient norm (2 on an H200,
torch 2.11), and one spare for a torch that also counts the phase timing events' read-back."""


def sync_warnings(step) -> list[str]:
    """The synchronizing-operation warnings torch gives during ``step()``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


@pytest.mark.parametrize("share_prefixes", [True, False])
def test_bf16_step_syncs_do_not_grow_with_micro_batches(share_prefixes):
    model = tiny_model()
    cfg = TrainerConfig(device="cuda", dtype="bfloat16", share_prefixes=share_prefixes, optim=OptimConfig(lr=1e-4))
    trainer = Trainer(model, cfg, max_tokens=16)
    ss = grpo_samples(model.config.vocab_size, teacher=False)
    trainer.step(step_batches(ss, 2))  # warm-up: kernels compiled, plans and handles made
    control = sync_warnings(lambda: torch.ones(1, device="cuda").item())
    assert control, "a plain .item() gave no sync warning: the warnings are not captured"
    one = sync_warnings(lambda: trainer.step(step_batches(ss, 1)))
    four = sync_warnings(lambda: trainer.step(step_batches(ss, 4)))
    assert one, "a step made no sync warning, yet it reads its stats and the gradient norm"
    assert len(four) == len(one) <= MAX_STEP_SYNCS, (one, four)
