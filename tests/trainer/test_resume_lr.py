"""``busctl up --resume RUN_DIR trainer.optim.lr=...``: the real trainer process logic
(:class:`trainer.proc.TrainerProc` over a real bus, as in tests/trainer/test_resume.py) stopped
after its checkpoint at step 2 and resumed with a quarter of the peak learning rate trains steps
2 and 3 with the new config's schedule, says so in one warning, and keeps the steps before the
checkpoint as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.launch_env import ENV_RESTARTS, ENV_RESUME
from bus.messages import RunDone, TrainerStep
from tests.trainer.test_resume import Packer, RunningTrainer, batches, read_jsonl, run_config, tiny_policy  # noqa: F401 - fixtures
from trainer.optim.lr_schedule import lr_factor
from trainer.state.checkpoint import list_checkpoints

OPTIM = {"scheduler": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}  # run_config's schedule; its lr: the default


def test_resume_with_a_lower_lr_trains_on_with_the_new_schedule(tiny_policy, batches, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV_RESTARTS, raising=False)
    monkeypatch.delenv(ENV_RESUME, raising=False)
    cfg = run_config(tmp_path, tiny_policy)
    peak = cfg.trainer.optim.lr
    packer = Packer(cfg)
    try:
        trainer = RunningTrainer(cfg)
        for mbs in batches[:3]:
            packer.send(mbs)
        packer.wait_for("trainer.step 3", lambda p: any(m.step == 3 for m in p.of_type(TrainerStep)), trainer)
        assert [p.name for p in list_checkpoints(Path(cfg.run_dir) / "checkpoints")] == ["step_000002"]
        trainer.stop()
        before = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")

        monkeypatch.setenv(ENV_RESUME, "1")
        lowered = run_config(tmp_path, tiny_policy, optim={**OPTIM, "lr": peak / 4})
        with caplog.at_level("WARNING", logger="trainer.dp_follower"):
            trainer = RunningTrainer(lowered)
        assert trainer.proc.start_step == 2
        packer.send(batches[3])  # step 2's micro-batches: re-sent by the packer's outbox (never released)
        packer.wait_for("run.done", lambda p: p.of_type(RunDone), trainer)
        trainer.stop()
    finally:
        packer.close()

    def rate(lr: float, step: int) -> float:
        return lr * lr_factor(step, schedule="cosine", warmup_steps=1, total_steps=4, min_lr_ratio=0.1)

    (warning,) = [r.getMessage() for r in caplog.records]
    assert (
        f"step 2: {rate(peak, 2):.4g} -> {rate(peak / 4, 2):.4g}" in warning
        and f"{peak:.4g} -> {peak / 4:.4g}" in warning
    )
    metrics = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert metrics[:2] == before[:2]  # the steps the checkpoint covers, as trained
    assert [r["lr"] for r in metrics] == pytest.approx(
        [rate(peak, 0), rate(peak, 1), rate(peak / 4, 2), rate(peak / 4, 3)], rel=1e-12
    )
    assert before[2]["lr"] == pytest.approx(rate(peak, 2), rel=1e-12)  # the stopped run's step 2, at the old rate
