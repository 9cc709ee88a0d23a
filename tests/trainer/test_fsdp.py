"""FSDP2 trainer (trainer/parallel/sharding.py, ``trainer.parallel: fsdp``): 2 gloo ranks under a real
torchrun give the one-rank update, publish the one-rank weights, and resume bit-identically
from their sharded checkpoint, which ``busctl export`` turns into a model directory on one process.

The steps and micro-batches are those of tests/trainer/test_data_parallel.py (step 0 on one rank,
checkpointed, so AdamW's moments are warm; then 4 steps with 2 micro-batches per rank, a padding
slot, a rank with padding only, and a step skipped for rank 1's inf loss). This file, run by
``python -m torch.distributed.run --standalone --nproc-per-node 2`` (``rank_main``), plays:

- run ``full``: both ranks load the one-rank checkpoint of step 0 (one file), shard (the
  optimizer keeps its AdamW state, :func:`trainer.parallel.sharding.shard_keeping_optimizer_state`), and
  train steps 1-4; rank 1 runs the production follower loop (:func:`trainer.dp_follower.serve`).
  After every step rank 0 sends the producers' payload (:func:`trainer.publish.weights_payload`,
  gathered one tensor at a time with rank 1) through a real filesystem weight sender; after step 2 it writes a
  sharded checkpoint (every rank its DCP shards, :func:`trainer.dp_follower.checkpoint_writer`);
- run ``resume``: both ranks start fresh from that sharded checkpoint as trainer.proc and
  trainer.dp_follower.follow do (shard, rank 0 names the checkpoint, every rank loads its shards) and
  train steps 3-4;
- ``busctl export`` of that sharded checkpoint (in this process, no process group): a directory that
  ``AutoModelForCausalLM`` and ``AutoTokenizer`` load, holding exactly the weights the ranks
  gathered after step 2; an older sharded checkpoint without ``config.json`` takes the run's
  ``model.path`` config.

Tolerances: 2 ranks vs 1 rank sum the same float32 gradients in another order (reduce-scatter of
two partial sums vs one accumulation), so losses and grad norms agree to ~1e-6 relative and
weights to ~1e-6 of their scale (rtol 1e-5, atol 1e-6, as the DDP test). A resumed run repeats
the very same float operations on the very same values: bit-identical (torch.equal).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from broadcaster.filesystem import WEIGHTS_FILE
from broadcaster.manifest import build_manifest
from busctl.cli import main as busctl_main
from configs.schema import LoraSection, RunConfig, TrainerConfig, dump_config, load_config
from policies.byte_tokenizer import build_tokenizer
from tests.trainer.test_data_parallel import LR, STEPS, TEMPERATURE, make_micro_batches, skipped_total, trainer_cfg
from trainer.state.checkpoint import save_checkpoint
from trainer.parallel.distributed import decode_share, encode_share
from trainer.parallel.sharding import SHARDED_DIR, read_sharded_policy
from trainer.state.model import load_policy, policy_state_dict
from trainer.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
SAVE_AFTER = 2
"""Run ``full`` writes its sharded checkpoint after this step (step=3 in the checkpoint's terms)."""


def payload_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().contiguous() for n, t in policy_state_dict(model).items()}


def sent(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights rank 0 sent by the filesystem method after ``step``."""
    return load_file(out / "weights" / f"v{step}" / WEIGHTS_FILE)


def torchrun(tmp_path: Path, mode: str, checkpoint: Path, out: Path) -> None:
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
        mode,
        str(tmp_path),
        str(checkpoint),
        str(out),
    ]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def one_rank_reference(model_dir: str, tmp_path: Path, dtype: str = "float32") -> tuple[list, list, Path]:
    """Train every step on one rank (float32); returns its metrics, its payload after each step
    and the checkpoint after step 0. Writes the steps' micro-batches and the 2-rank config
    (``dtype``: its trainer.dtype) into ``tmp_path``."""
    tcfg = trainer_cfg()
    torch.manual_seed(tcfg.seed)
    model = load_policy(model_dir, tcfg.lora)
    steps = [make_micro_batches(model, s) for s in range(len(STEPS))]
    trainer = Trainer(model, tcfg)
    reference = [trainer.step(steps[0])]
    checkpoint = save_checkpoint(tmp_path / "checkpoints", step=1, model=model, optimizer=trainer.optimizer, extra={})
    payloads = [payload_copy(model)]
    for mbs in steps[1:]:
        reference.append(trainer.step(mbs))
        payloads.append(payload_copy(model))
    assert [m["skipped"] for m in reference] == [0.0, 0.0, 0.0, 0.0, 1.0]

    for s, mbs in enumerate(steps):
        (tmp_path / f"step{s}.bin").write_bytes(encode_share(mbs))
    cfg = RunConfig(
        trainer=TrainerConfig(
            **{
                **tcfg.model_dump(),
                "data_parallel": 2,
                "dp_backend": "gloo",
                "dp_timeout_s": 120,
                "parallel": "fsdp",
                "dtype": dtype,
            }
        )
    )
    cfg.model.path = model_dir
    cfg.sampling.temperature = TEMPERATURE
    cfg.run_dir = str(tmp_path)
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    return reference, payloads, checkpoint


def with_tokenizer(model_dir: str, tmp_path: Path) -> str:
    """A copy of ``model_dir`` with the tiny policy's byte tokenizer and chat template (the
    checkpoints of a run from it carry them)."""
    policy = tmp_path / "policy"
    shutil.copytree(model_dir, policy)
    build_tokenizer().save_pretrained(policy)
    return str(policy)


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model.eval()(torch.tensor([ids])).logits[0]


def check_sharded_export(run_dir: Path, policy: str, step: int, trained: dict[str, torch.Tensor]) -> None:
    """``busctl export`` of the sharded checkpoint of ``step`` in ``run_dir`` holds exactly
    ``trained`` (the weights the ranks gathered at that step) and the policy's tokenizer; so
    does that of a copy without its config and tokenizer files (a checkpoint written before
    sharded ones held them: they come from the run's ``model.path``)."""
    checkpoint = run_dir / "checkpoints" / f"step_{step:06d}"
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in checkpoint.iterdir()
    }  # rank 0 wrote them beside the shards
    source = AutoTokenizer.from_pretrained(policy)
    ids = source.apply_chat_template(
        [{"role": "user", "content": "Reverse: abc"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reference = load_policy(policy, LoraSection())
    reference.load_state_dict(trained)
    old = run_dir / "old_run"
    shutil.copytree(
        checkpoint, old / "checkpoints" / checkpoint.name, ignore=shutil.ignore_patterns("*.json", "*.jinja", "*.txt")
    )  # meta.json is written back below
    shutil.copy(checkpoint / "meta.json", old / "checkpoints" / checkpoint.name / "meta.json")
    shutil.copy(run_dir / "config.yaml", old / "config.yaml")
    for run, out in ((run_dir, run_dir / "exported"), (old, old / "exported")):
        assert busctl_main(["export", str(run), "--step", str(step), "--out", str(out)]) == 0
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
        assert SHARDED_DIR not in names and "meta.json" not in names and not any(n.endswith(".pt") for n in names)
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer.chat_template == source.chat_template
        assert (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "Reverse: abc"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            == ids
        )
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        weights = exported.state_dict()
        assert set(weights) == set(trained)
        assert all(torch.equal(weights[n], trained[n]) for n in trained), run
        torch.testing.assert_close(logits(exported, ids), logits(reference, ids), rtol=0, atol=0)
    other = AutoConfig.from_pretrained(policy)
    other.intermediate_size *= 2  # the MLP shards of the saved width do not fill a wider one
    with pytest.raises(ValueError, match="do not fit"):
        read_sharded_policy(checkpoint / SHARDED_DIR, other)


def test_two_fsdp_ranks_give_the_one_rank_update_and_resume_identically(model_dir, tmp_path):
    policy = with_tokenizer(model_dir, tmp_path)
    reference, payloads, checkpoint = one_rank_reference(policy, tmp_path)

    full = tmp_path / "full"
    torchrun(tmp_path, "full", checkpoint, full)
    metrics = json.loads((full / "metrics.json").read_text())
    assert len(metrics) == len(STEPS) - 1
    for s, (ref, got) in enumerate(zip(reference[1:], metrics), start=1):
        assert got["skipped"] == ref["skipped"], s
        for key in ("num_tokens", "num_loss_tokens", "num_samples", "num_micro_batches"):
            assert got[key] == ref[key], (s, key)
        if not ref["skipped"]:
            for key in ("loss", "kl", "importance_ratio_mean", "grad_norm"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (s, key)
        else:
            assert not np.isfinite(got["loss"]) and got["non_finite_loss_skips"] == 1.0
    # the payload rank 0 gathered after every step = the one-rank model's payload (all HF names)
    for s in range(1, len(STEPS)):
        got = sent(full, s)
        manifest = json.loads((full / f"manifest_step{s}.json").read_text())
        assert sorted(manifest) == sorted(build_manifest(payloads[s])), s  # names, dtypes, shapes
        assert set(got) == set(payloads[s]), s
        for name, ref in payloads[s].items():
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=f"step {s} {name}")
    last, before_skip = (sent(full, s) for s in (len(STEPS) - 1, len(STEPS) - 2))
    assert all(torch.equal(last[n], before_skip[n]) for n in last)  # the skipped step changed nothing
    sharded = tmp_path / "checkpoints" / f"step_{SAVE_AFTER + 1:06d}"
    assert (sharded / "DONE").is_file() and (sharded / "sharded" / ".metadata").is_file()
    assert json.loads((sharded / "meta.json").read_text())["sharded"] is True
    assert not (sharded / "optimizer.pt").exists()
    check_sharded_export(tmp_path, policy, SAVE_AFTER + 1, sent(full, SAVE_AFTER))

    resumed = tmp_path / "resume"
    torchrun(tmp_path, "resume", sharded, resumed)
    for s in range(SAVE_AFTER + 1, len(STEPS)):  # the same next steps, bit for bit
        a, b = sent(full, s), sent(resumed, s)
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a), s
    for rank in (0, 1):  # each rank's AdamW shards at the end, identical too
        a, b = load_file(full / f"optim_rank{rank}.safetensors"), load_file(resumed / f"optim_rank{rank}.safetensors")
        assert a and set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a), rank
    resumed_metrics = json.loads((resumed / "metrics.json").read_text())
    for got, ref in zip(resumed_metrics, metrics[SAVE_AFTER:]):
        assert got["loss"] == ref["loss"] or not np.isfinite(ref["loss"])
        assert got["grad_norm"] == ref["grad_norm"] or not np.isfinite(ref["grad_norm"])


def test_two_fsdp_ranks_in_bfloat16_keep_float32_master_weights(model_dir, tmp_path):
    """trainer.dtype bfloat16 (MixedPrecisionPolicy: bf16 compute, fp32 reduce): the sharded
    master weights and AdamW state stay float32 and training follows the float32 run. bfloat16
    has 8 mantissa bits (relative rounding 2**-9 = 2e-3 per operation), so the losses agree to
    ~1e-2 relative, and weights after 3 AdamW steps of lr 1e-3 to a few lr (an update is
    ~lr * sign(m / sqrt(v)): where bf16 noise flips the sign of a tiny gradient, 2 lr apart)."""
    reference, payloads, checkpoint = one_rank_reference(model_dir, tmp_path, dtype="bfloat16")
    out = tmp_path / "bf16"
    torchrun(tmp_path, "full", checkpoint, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert any(got["loss"] != ref["loss"] for got, ref in zip(metrics, reference[1:4]))  # bf16 did compute
    for s, (ref, got) in enumerate(zip(reference[1:], metrics), start=1):
        assert got["skipped"] == ref["skipped"], s
        if not ref["skipped"]:
            assert got["loss"] == pytest.approx(ref["loss"], rel=3e-2, abs=1e-3), s
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=3e-2), s
    for s in range(1, len(STEPS)):
        got = sent(out, s)
        assert all(t.dtype == torch.float32 for t in got.values())  # the master weights: float32
        for name, ref in payloads[s].items():
            torch.testing.assert_close(got[name], ref, rtol=0, atol=6 * LR, msg=f"step {s} {name}")
    for rank in (0, 1):
        state = load_file(out / f"optim_rank{rank}.safetensors")
        assert state and all(t.dtype == torch.float32 for t in state.values())
    # gathered one tensor at a time and cast on the way: the bfloat16 wire carries exactly the
    # float32 master weights rounded to bfloat16, at half the bytes
    for s in range(1, len(STEPS)):
        master, wire = sent(out, s), load_file(out / "weights_bf16" / f"v{s}" / WEIGHTS_FILE)
        assert set(wire) == set(master) and all(t.dtype == torch.bfloat16 for t in wire.values())
        for name, tensor in master.items():
            assert torch.equal(wire[name], tensor.to(torch.bfloat16)), (s, name)


def optimizer_shards(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's local AdamW state: ``{param_name.key: local shard}``."""
    out = {}
    for name, p in trainer.model.named_parameters():
        for key, value in trainer.optimizer.state.get(p, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"{name}.{key}"] = local.detach().clone().contiguous().reshape(-1)
    return out


def rank_main(mode: str, run_dir: str, checkpoint: str, out: str) -> int:
    """One rank of run ``mode`` ("full" or "resume", see the module docstring); writes into ``out``."""
    import signal

    from broadcaster.filesystem import FilesystemSender
    from lifecycle.parent_death import die_with_parent
    from trainer.dp_follower import checkpoint_writer, follow, join_data_parallel, load_trainer_checkpoint, serve
    from trainer.publish import weights_payload

    die_with_parent(signal.SIGTERM)
    torch.set_num_threads(1)
    cfg = load_config(Path(run_dir) / "config.yaml")
    dp = join_data_parallel(cfg)
    out_dir = Path(out)
    first = 1 if mode == "full" else SAVE_AFTER + 1
    try:
        if mode == "resume" and not dp.is_leader:
            trainer = follow(cfg, dp)  # shard, take the checkpoint's name, load the shards, serve
        else:
            torch.manual_seed(cfg.trainer.seed)
            trainer = Trainer(load_policy(cfg.model.path, cfg.trainer.lora), cfg.trainer)
            if mode == "full":  # the one-rank checkpoint, then shard: AdamW's state comes along
                load_trainer_checkpoint(Path(checkpoint), trainer)
                trainer.enable_data_parallel(dp)
            else:  # as TrainerProc.setup: shard, name the checkpoint, load the shards with rank 1
                trainer.enable_data_parallel(dp)
                dp.send_text(checkpoint)
                load_trainer_checkpoint(Path(checkpoint), trainer)
            if not dp.is_leader:
                serve(trainer, dp)
        if dp.is_leader:
            metrics = []
            for s in range(first, len(STEPS)):
                micro_batches = decode_share((Path(run_dir) / f"step{s}.bin").read_bytes())
                skips = skipped_total("non_finite_loss")
                m = trainer.step(dp.send_step(micro_batches))
                m["non_finite_loss_skips"] = skipped_total("non_finite_loss") - skips
                metrics.append(m)
                payload = weights_payload(trainer.model, cfg, s + 1, adapter=False, dp=dp)
                info = FilesystemSender(out_dir / "weights", keep_versions=None).send(payload, s)  # gathers with rank 1
                (out_dir / f"manifest_step{s}.json").write_text(json.dumps(info["manifest"]))
                if cfg.trainer.dtype == "bfloat16":  # and once more on a bfloat16 wire (producers.dtype bfloat16)
                    payload = weights_payload(trainer.model, cfg, s + 1, adapter=False, dp=dp)
                    FilesystemSender(out_dir / "weights_bf16", keep_versions=None).start_send(
                        payload, s, manifest=build_manifest(payload, torch.bfloat16)
                    )
                if mode == "full" and s == SAVE_AFTER:
                    save_checkpoint(
                        Path(run_dir) / "checkpoints",
                        step=s + 1,
                        model=trainer.model,
                        optimizer=trainer.optimizer,
                        extra={},
                        write_state=checkpoint_writer(trainer),
                    )
            dp.send_stop()
            trainer.disable_data_parallel()
            (out_dir / "metrics.json").write_text(json.dumps(metrics))
        save_file(optimizer_shards(trainer), out_dir / f"optim_rank{dp.rank}.safetensors")
        return 0
    finally:
        dp.close()


if __name__ == "__main__":  # a rank under torchrun: mode run_dir checkpoint out
    raise SystemExit(rank_main(*sys.argv[1:5]))
