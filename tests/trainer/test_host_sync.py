"""The trainer's micro-batch loop never makes the host wait for the device (issue 28's next step).

On a GPU every host sync inside the micro-batch loop (``float(loss)``, ``nonzero``, ``.tolist()``,
a boolean-mask index, ``int(lens.sum())``) stops the host from queueing the next kernels while
the device runs the current ones. These tests run real `Trainer.step`s on a real tiny Qwen2 policy
under `tests.host_sync.host_syncs`, which records every such operation on a CPU, and assert that
a step reads the device back a fixed number of times (its stats and its gradient norm), whatever
the number of micro-batches, for every loss type and option that adds inputs. The same rule on a
real GPU: tests/gpu/test_gpu_host_sync.py (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bus.messages import ScoredGroup
from configs.schema import LoraSection, OptimConfig, TrainerConfig
from configs.training import LossConfig
from tests.host_sync import host_syncs
from tests.scored_groups import packed_step, scored
from trainer.state.model import load_policy
from trainer.trainer import Trainer

ALLOWED = ("trainer/observability/step_stats.py", "trainer/parallel/sharding.py")
"""Where a step may read the device back: the one read-back of every micro-batch's stats, and the
gradient norm (the non-finite guard decides on both)."""


def grpo_samples(vocab: int, *, teacher: bool, seed: int = 0) -> list[ScoredGroup]:
    """Two groups of 4 completions sharing their group's prompt (so shared prefixes apply), with
    mixed policy versions (lags 0 and 1) and per-token sampler logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        prompt = rng.integers(0, vocab, 6).tolist()
        comps = [rng.integers(0, vocab, int(rng.integers(2, 7))).tolist() for _ in range(4)]
        lps = [rng.uniform(-6, -4, len(c)).astype(np.float32) for c in comps]
        out.append(
            scored(
                f"g{g}",
                prompt,
                comps,
                version=[1 - (j % 2) for j in range(4)],
                advantages=rng.choice([-1.0, 1.0], 4).tolist(),
                logprobs=lps,
                **({"teacher_logprobs": np.concatenate(lps) - np.float32(0.1)} if teacher else {}),
            )
        )
    return out


def step_batches(groups: list[ScoredGroup], parts: int):
    """The groups' samples as one step of ``parts`` micro-batches (step 1)."""
    n = sum(g.group_size for g in groups)
    return packed_step(groups, np.array_split(np.arange(n), parts), step=1, teacher=groups[0].teacher_logprobs.size > 0)


LOSSES = {
    "aipo": {},
    "aipo_sequence_tis_kl_ref": {"ratio_type": "sequence", "use_tis": True, "kl_tau": 0.1, "kl_reference": "reference"},
    "ppo_clip_dual": {"type": "ppo_clip", "eps_clip_c": 3.0, "kl_tau": 0.05, "kl_reference": "rollout"},
    "gspo": {"type": "gspo"},
    "importance_sampling_teacher": {"type": "importance_sampling", "teacher_tau": 0.5},
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("share_prefixes", [True, False])
def test_a_step_reads_the_device_back_a_fixed_number_of_times(model_dir, loss, share_prefixes):
    torch.manual_seed(0)
    model = load_policy(model_dir, LoraSection(enabled=False))
    cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-4, max_grad_norm=1.0), share_prefixes=share_prefixes, loss=LossConfig(**LOSSES[loss])
    )
    trainer = Trainer(model, cfg, max_tokens=16)
    ss = grpo_samples(model.config.vocab_size, teacher="teacher" in loss)
    trainer.step(step_batches(ss, 1))  # warm-up: lazy initializations may read the device once
    found = {}
    for parts in (1, 3):
        with host_syncs() as spy:
            metrics = trainer.step(step_batches(ss, parts))
        found[parts] = spy.found
        assert metrics["num_micro_batches"] == parts and metrics["skipped"] == 0.0
        assert metrics["num_loss_tokens"] == sum(int(g.completion_lens.sum()) for g in ss)
        assert 0 < metrics["onpolicy_tokens"] < metrics["num_loss_tokens"]  # lags 0 and 1 both present
    outside = [
        (what, where) for what, where in found[3] if not where.startswith(tuple(f"{_root()}/{a}" for a in ALLOWED))
    ]
    assert outside == [], f"host syncs in the micro-batch loop: {outside}"
    assert len(found[3]) == len(found[1]) == 2, found


@pytest.mark.parametrize("lora", [False, True])
def test_bfloat16_step_reads_the_device_back_a_fixed_number_of_times(model_dir, lora):
    torch.manual_seed(0)
    model = load_policy(model_dir, LoraSection(enabled=lora, rank=4, alpha=8.0))
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-4), dtype="bfloat16", share_prefixes=True, lm_head_dtype="bfloat16")
    trainer = Trainer(model, cfg, max_tokens=16)
    ss = grpo_samples(model.config.vocab_size, teacher=False, seed=1)
    trainer.step(step_batches(ss, 2))
    with host_syncs() as spy:
        trainer.step(step_batches(ss, 4))
    assert len(spy.found) == 2, spy.found


def test_the_spy_sees_what_the_old_loop_did(model_dir):
    """The spy is not blind: the operations the loop used to make are each recorded."""
    values = torch.tensor([1.0, -2.0, 3.0])
    with host_syncs() as spy:
        float(values.sum())
        values[values > 0].sum()
        torch.nonzero(values)
        values.tolist()
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)  # sized: no sync
    kinds = [what for what, _where in spy.found]
    assert kinds == [
        "item/float/int/bool of a tensor",
        "aten.index.Tensor with a boolean mask",
        "nonzero",
        "Tensor.tolist",
        "repeat_interleave without output_size",
    ], kinds


def test_bad_micro_batch_inputs_are_refused_before_the_forward(model_dir):
    """Checked on the host now: a non-finite sampler logprob on a loss token is named with its token."""
    model = load_policy(model_dir, LoraSection(enabled=False))
    trainer = Trainer(model, TrainerConfig(), max_tokens=16)
    ss = grpo_samples(model.config.vocab_size, teacher=False)
    mb = step_batches(ss, 1)[0]
    token = int(np.flatnonzero(mb.loss_mask)[2])
    bad = np.array(mb.sampler_logprobs)
    bad[token] = np.nan
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"sampler_logprobs must be finite on loss tokens, got nan at token {token}"):
        trainer.step([dataclasses.replace(mb, sampler_logprobs=bad)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _root() -> str:
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[2])
