"""Data-parallel trainer (trainer/parallel/distributed.py, trainer/dp_follower.py): 2 gloo ranks under a real
torchrun give the same parameter update as 1 rank on the same step.

The 2-rank run is this file executed by ``python -m torch.distributed.run --standalone
--nproc-per-node 2`` (see ``rank_main`` at the bottom): rank 0 plays :class:`trainer.proc.TrainerProc`
without the bus (it resumes from a checkpoint, names it to the other rank, shares each step with
``DataParallel.send_step``); rank 1 runs the production follower, :func:`trainer.dp_follower.follow`.
The 1-rank reference runs in the test process on the same micro-batches.

Steps (full fine-tuning of the tiny Qwen2 of conftest.py, AdamW):
    0  2 micro-batches, 1 rank only; checkpointed: both runs continue from it, so AdamW's moments
       are warm (its first update is ~lr * sign(g), which would amplify float noise where g ~ 0)
       and the follower must load the optimizer state too, or its weights drift from rank 0's;
    1  4 micro-batches of mixed lengths: 2 per rank;
    2  3 micro-batches: one rank gets a padding slot (dummy forward, zero loss);
    3  1 micro-batch: rank 1 runs padding only;
    4  2 micro-batches, the smaller one (rank 1's) with an advantage that overflows its loss to
       inf: both ranks must skip the optimizer step, rank 0 for a loss it never computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed as dist
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from bus.codec import encode
from bus.messages import RunDone
from busctl.components.table import ComponentSpec, free_port, launch_prefix
from configs.schema import LoraSection, OptimConfig, RunConfig, TrainerConfig, dump_config, load_config
from tests.scored_groups import packed_step, scored
from trainer.state.checkpoint import save_checkpoint
from trainer.parallel.distributed import DataParallel, decode_share, encode_share, share_micro_batches
from trainer.state.model import load_policy
from trainer.forward.packed import packed_token_logprobs
from trainer.trainer import Trainer, merge_stats

REPO_ROOT = Path(__file__).resolve().parents[2]
LR = 1e-3
TEMPERATURE = 0.9

# per step: micro-batches, each a list of samples (prompt tokens, completion tokens, advantage, reward)
STEPS = [
    [[([1, 2, 3], [40, 41, 42, 43], 1.0, 1.0)], [([4, 5], [60, 61, 62], -1.0, 0.0), ([6], [70, 71], 0.5, 0.5)]],
    [
        [([7, 8, 9, 10], [80, 81, 82, 83, 84, 85], 1.0, 1.0), ([11], [90, 91], -0.5, 0.25)],
        [([12, 13], [100, 101, 102], -1.0, 0.0)],
        [([14, 15, 16], [110, 111, 112, 113], 0.75, 0.75), ([17], [120], -0.25, 0.5), ([18, 19], [130, 131], 0.1, 0.6)],
        [([20], [140, 141, 142, 143, 144], 0.3, 0.8)],
    ],
    [
        [([21, 22], [150, 151, 152, 153], -0.8, 0.1)],
        [([23, 24, 25], [160, 161], 0.6, 0.9), ([26], [170, 171, 172], -0.6, 0.2)],
        [([27], [180, 181], 0.2, 0.4)],
    ],
    [[([28, 29, 30], [190, 191, 192, 193, 194], 1.0, 1.0), ([31], [200, 201], -1.0, 0.0)]],
    [
        [([32, 33, 34, 35], [210, 211, 212, 213], 0.5, 0.7), ([36, 37], [220, 221, 222], -0.5, 0.3)],
        [([38], [230, 231], 3e38, 1.0)],  # smaller: rank 1's share; A * lp overflows float32 to inf
    ],
]


def trainer_cfg(lora: bool = False) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=LR, max_grad_norm=1.0), num_threads=1, lora=LoraSection(enabled=lora, rank=4, alpha=8.0)
    )


def make_micro_batches(model: torch.nn.Module, step: int) -> list:
    """Step ``step``'s micro-batches; sampler logprobs are the model's own, perturbed so the
    importance ratios (and their min/max, the KL) are not trivially 1."""
    groups = STEPS[step]
    rng = np.random.default_rng(step)
    samples, split = [], []
    for m, specs in enumerate(groups):
        split.append(list(range(len(samples), len(samples) + len(specs))))
        for k, (prompt, completion, advantage, reward) in enumerate(specs):
            ids = prompt + completion
            with torch.no_grad():
                lp = packed_token_logprobs(
                    model, torch.tensor(ids), torch.tensor([len(ids)]), temperature=TEMPERATURE
                ).numpy()
            lp = (lp + rng.normal(0.0, 0.05, len(ids)))[len(prompt) :]
            samples.append(
                scored(
                    f"s{step}-{m}-{k}",
                    prompt,
                    [completion],
                    version=step,
                    advantages=[advantage],
                    rewards=[reward],
                    logprobs=[lp],
                    temperature=TEMPERATURE,
                )
            )
    return packed_step(samples, split, step=step)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def skipped_total(reason: str) -> float:
    return REGISTRY.get_sample_value("rlbus_trainer_skipped_steps_total", {"reason": reason}) or 0.0


# -- pure pieces ------------------------------------------------------------------------------------


def test_share_micro_batches_balances_tokens_lpt():
    # tokens [5, 9, 3, 7], 2 ranks, 2 slots each. LPT: 9 -> r0 (0 vs 0, lower rank); 7 -> r1 (0 < 9);
    # 5 -> r1 (7 < 9); 3 -> r0 (9 < 12)
    assert share_micro_batches([5, 9, 3, 7], 2) == [[1, 2], [3, 0]]
    # 3 micro-batches on 2 ranks: 2 slots; 8 -> r0, 6 -> r1, 4 -> r1 (6 < 8): rank 0 is one short
    assert share_micro_batches([4, 8, 6], 2) == [[1], [2, 0]]
    # fewer micro-batches than ranks: rank 0 gets the one, the others pad only
    assert share_micro_batches([3], 3) == [[0], [], []]
    # ties: lower index first, to the lower rank
    assert share_micro_batches([2, 2, 2, 2], 2) == [[0, 2], [1, 3]]
    assert share_micro_batches([4, 1], 1) == [[0, 1]]
    for bad in (([], 2), ([3, 0], 2), ([3], 0)):
        with pytest.raises(ValueError):
            share_micro_batches(*bad)


def test_share_round_trips_micro_batches_through_the_wire_codec(model_dir):
    model = load_policy(model_dir, LoraSection())
    mbs = make_micro_batches(model, 2)
    back = decode_share(encode_share(mbs))
    assert len(back) == len(mbs)
    for a, b in zip(mbs, back):
        assert [bytes(f) for f in encode(a)] == [bytes(f) for f in encode(b)]
    assert decode_share(encode_share([])) == []
    with pytest.raises(ValueError, match="list of frame lists"):
        decode_share(msgpack.packb({"not": "a list"}))
    not_a_micro_batch = msgpack.packb([[bytes(f) for f in encode(RunDone(id="x", step=1, reason="max_steps"))]])
    with pytest.raises(ValueError, match="micro-batches only"):
        decode_share(not_a_micro_batch)


def test_merge_stats_sums_and_takes_min_and_max():
    a = {"loss_tokens": 3.0, "ratio_min": 0.5, "ratio_max": 1.5, "kl_sum": 0.25}
    b = {"loss_tokens": 4.0, "ratio_min": 0.25, "ratio_max": 1.25, "entropy_sum": 2.0}
    assert merge_stats(a, b) == {
        "loss_tokens": 7.0,
        "ratio_min": 0.25,
        "ratio_max": 1.5,
        "kl_sum": 0.25,
        "entropy_sum": 2.0,
    }
    assert merge_stats({}, a) == a and merge_stats(a, {}) == a


def test_padding_slots_need_data_parallel(model_dir):
    model = load_policy(model_dir, LoraSection())
    trainer = Trainer(model, trainer_cfg())
    with pytest.raises(ValueError, match="data-parallel"):
        trainer.step([*make_micro_batches(model, 3), None])
    with pytest.raises(ValueError, match="all of one step"):
        trainer.step([])


def test_data_parallel_outside_torchrun_is_a_config_error(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        DataParallel.from_env("gloo", 10.0, world_size=2)


def test_busctl_launches_a_data_parallel_trainer_under_torchrun():
    cfg = RunConfig(trainer=TrainerConfig(data_parallel=3))
    assert launch_prefix(cfg, ComponentSpec("trainer", "trainer.proc")) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "-m",
        "trainer.proc",
    ]
    assert launch_prefix(cfg, ComponentSpec("rewards-0", "rewards.proc")) == [sys.executable, "-m", "rewards.proc"]
    one = RunConfig()
    assert launch_prefix(one, ComponentSpec("trainer", "trainer.proc")) == [sys.executable, "-m", "trainer.proc"]


# -- 2 gloo ranks vs 1 rank -------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_gloo_ranks_give_the_one_rank_update(model_dir, tmp_path, lora):
    # the 1-rank reference, in this process
    tcfg = trainer_cfg(lora)
    torch.manual_seed(tcfg.seed)
    model = load_policy(model_dir, tcfg.lora)
    steps = [make_micro_batches(model, s) for s in range(len(STEPS))]
    trainer = Trainer(model, tcfg)
    skipped_before = skipped_total("non_finite_loss")
    reference = [trainer.step(steps[0])]
    checkpoint = save_checkpoint(tmp_path / "checkpoints", step=1, model=model, optimizer=trainer.optimizer, extra={})
    params = [trainable(model)]
    for mbs in steps[1:]:
        reference.append(trainer.step(mbs))
        params.append(trainable(model))
    assert [m["skipped"] for m in reference] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert all(not torch.equal(params[1][n], params[0][n]) for n in params[0] if "lora_A" not in n)  # it trains
    assert skipped_total("non_finite_loss") == skipped_before + 1

    # the same steps on 2 ranks, resumed from the checkpoint after step 0
    for s, mbs in enumerate(steps):
        (tmp_path / f"step{s}.bin").write_bytes(encode_share(mbs))
    cfg = RunConfig(
        trainer=TrainerConfig(**{**tcfg.model_dump(), "data_parallel": 2, "dp_backend": "gloo", "dp_timeout_s": 120})
    )
    cfg.model.path = model_dir
    cfg.sampling.temperature = TEMPERATURE
    cfg.run_dir = str(tmp_path)
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        str(tmp_path),
        str(checkpoint),
        str(len(STEPS)),
        str(out),
    ]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics) == len(STEPS) - 1
    for s, (ref, got) in enumerate(zip(reference[1:], metrics), start=1):
        assert got["skipped"] == ref["skipped"], s
        assert got["num_micro_batches"] == ref["num_micro_batches"] == len(steps[s]), s
        for key in ("num_tokens", "num_loss_tokens", "num_samples", "onpolicy_tokens"):
            assert got[key] == ref[key], (s, key)
        for key in ("reward_mean", "reward_std", "masked_frac", "importance_ratio_min", "importance_ratio_max"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6), (s, key)
        if not ref["skipped"]:
            for key in ("loss", "kl", "importance_ratio_mean", "grad_norm", "onpolicy_lp_diff_max"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (s, key)
        else:  # rank 0's own micro-batch was finite: it skipped for rank 1's inf loss
            assert not np.isfinite(got["loss"]) and got["non_finite_loss_skips"] == 1.0
    # parameters after every step: float32 sums in another order, so equal to ~1e-6 of their scale
    for s in range(1, len(STEPS)):
        got = load_file(out / f"rank0_step{s}.safetensors")
        assert set(got) == set(params[s])
        for name, ref in params[s].items():
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=f"step {s} {name}")
    # the skipped step changed nothing, and rank 1 ends bit-identical to rank 0
    final0 = load_file(out / f"rank0_step{len(STEPS) - 1}.safetensors")
    before_skip = load_file(out / f"rank0_step{len(STEPS) - 2}.safetensors")
    final1 = load_file(out / "rank1_final.safetensors")
    for name in final0:
        assert torch.equal(final0[name], before_skip[name]), name
        assert torch.equal(final1[name], final0[name]), name


def rank_main(run_dir: str, checkpoint: str, num_steps: int, out: str) -> int:
    """One rank of the 2-rank run (see the module docstring); writes into ``out``."""
    import signal

    from lifecycle.parent_death import die_with_parent
    from trainer.dp_follower import follow, join_data_parallel, load_trainer_checkpoint

    die_with_parent(signal.SIGTERM)  # if the test kills torchrun, its ranks go too
    torch.set_num_threads(1)
    cfg = load_config(Path(run_dir) / "config.yaml")
    dp = join_data_parallel(cfg)
    out_dir = Path(out)
    try:
        if not dp.is_leader:
            trainer = follow(cfg, dp)
            save_file(trainable(trainer.model), out_dir / f"rank{dp.rank}_final.safetensors")
            return 0
        # rank 0 can still host a store of its own (the weight-broadcast group's: vLLM's stateless
        # group rendezvous the same way); under torchrun's agent-store setting it would wait as a client
        url = f"tcp://127.0.0.1:{free_port()}?rank=0&world_size=1"
        store, _, _ = next(dist.rendezvous(url, timeout=timedelta(seconds=20)))
        del store
        # rank 0 as TrainerProc.setup: same seed, policy, trainer, checkpoint; names it; DDP
        torch.manual_seed(cfg.trainer.seed)
        model = load_policy(cfg.model.path, cfg.trainer.lora)
        trainer = Trainer(model, cfg.trainer)
        load_trainer_checkpoint(Path(checkpoint), trainer)
        dp.send_text(checkpoint)
        trainer.enable_data_parallel(dp)
        metrics = []
        for s in range(1, num_steps):
            micro_batches = decode_share((Path(run_dir) / f"step{s}.bin").read_bytes())
            skips = skipped_total("non_finite_loss")
            m = trainer.step(dp.send_step(micro_batches))
            m["non_finite_loss_skips"] = skipped_total("non_finite_loss") - skips
            metrics.append(m)
            save_file(trainable(model), out_dir / f"rank0_step{s}.safetensors")
        dp.send_stop()
        trainer.disable_data_parallel()
        (out_dir / "metrics.json").write_text(json.dumps(metrics))
        return 0
    finally:
        dp.close()


if __name__ == "__main__":  # a rank under torchrun: run_dir checkpoint num_steps out
    raise SystemExit(rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
