"""A trainer that never waits for data (issue 29, point 3): when the trainer is the bottleneck (every
GPU run) the next step's micro-batches are always buffered, so its wait for data never runs. A real
:class:`trainer.proc.TrainerProc` whose every step is buffered before it starts logs one line per
step, never waits, writes no eval record (the packer writes those, eval.jsonl), subscribes to the
control channel only for its last step, and sends ``run.done`` only once the final eval round's
result came.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from lifecycle.launch_env import ENV_RESTARTS, ENV_RESUME
from bus.messages import EvalResult, RunDone, TrainerStep, new_id
from tests.trainer.test_resume import WAIT_S, Packer, batches, read_jsonl, run_config, tiny_policy  # noqa: F401 - fixtures
from trainer.proc import TrainerProc


def result(rnd: int, task: str, reward: float) -> EvalResult:
    return EvalResult(
        id=new_id(),
        round=rnd,
        task=task,
        version_min=rnd,
        version_max=rnd,
        num_samples=4,
        num_failed=0,
        metrics={"reward_mean": reward},
    )


def eval_keys(path) -> list[tuple[int, str]]:
    """(step, task) of every eval record of a metrics.jsonl, in file order (none if it does not
    exist yet; a line being appended right now is left out)."""
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # complete lines only
    return [
        (r["step"], k.split("/")[1])
        for r in map(json.loads, lines)
        for k in r
        if k.endswith("/reward_mean") and k.startswith("eval/")
    ]


class Alive:
    """What :meth:`Packer.wait_for` asks of a trainer: fail at once when its run() failed."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors

    def check(self, what: str) -> None:
        assert not self.errors, f"the trainer failed while waiting for {what}: {self.errors!r}"


def test_a_trainer_that_never_waits_for_data_logs_every_step_and_waits_for_the_final_eval_round(
    tiny_policy, batches, tmp_path, monkeypatch, caplog
):
    """Every step's micro-batches are in the trainer's ledger before ``run()`` starts, so its wait
    loop never runs; each step logs one line with loss, reward, KL, time, lag; ``run.done`` comes
    only after the final round's (4) result."""
    monkeypatch.delenv(ENV_RESTARTS, raising=False)
    monkeypatch.delenv(ENV_RESUME, raising=False)
    tasks = [{"name": "reverse_text"}]
    cfg = run_config(
        tmp_path,
        tiny_policy,
        eval={"enabled": True, "interval": 2, "tasks": tasks, "timeout_s": WAIT_S},
        checkpoint_interval=4,
    )
    metrics_path = tmp_path / "metrics.jsonl"
    packer = Packer(cfg)
    proc = TrainerProc(cfg, "trainer", 0)
    errors: list[BaseException] = []
    runner = None
    try:
        proc.setup()
        assert proc.final_eval is None  # no control subscriber piling up messages while it trains
        for mbs in batches:
            packer.send(mbs)
        deadline = time.monotonic() + WAIT_S
        while not all(proc.ledger.is_complete(s) for s in range(len(batches))):  # the whole run buffered
            assert time.monotonic() < deadline, f"buffered steps {proc.ledger.buffered_steps()}"
            proc.take_in(proc.batches.recv(timeout_s=0.1))

        def run() -> None:
            try:
                proc.run()
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        with caplog.at_level(logging.INFO, logger="trainer.proc"):
            runner = threading.Thread(target=run, daemon=True)
            runner.start()
            alive = Alive(errors)
            packer.wait_for("trainer.step 4", lambda p: any(m.step == 4 for m in p.of_type(TrainerStep)), alive)
            until = time.monotonic() + 1.0
            packer.wait_for("1 s more of control messages", lambda p: time.monotonic() > until, alive)
            assert proc.final_eval is not None and not packer.of_type(RunDone), "run.done before the final round"

            def final_round_published(p: Packer) -> bool:
                p.publish.send(result(4, "reverse_text", 0.4))  # repeated until the trainer has it
                return bool(p.of_type(RunDone))

            packer.wait_for("run.done", final_round_published, alive)
            runner.join(WAIT_S)
        assert not errors, errors
    finally:
        proc.stop.set()
        if runner is not None:
            runner.join(WAIT_S)
        proc.close()
        packer.close()
    records = read_jsonl(metrics_path)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["time/wait_data_s"] < 0.05 for r in steps), [r["time/wait_data_s"] for r in steps]  # it never waited
    assert eval_keys(metrics_path) == []  # the packer's records (eval.jsonl), not the trainer's
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.proc" and r.getMessage().startswith("step ")]
    assert len(lines) == 4, lines
    for n, (line, rec) in enumerate(zip(lines, steps), start=1):
        assert re.fullmatch(
            rf"step {n}/4 loss \S+ reward \S+ \(std \S+\) kl \S+ entropy \S+ grad_norm \S+ "
            r"step \d+\.\d\d s \(wait \d+\.\d\d s\) lag \d\.\d\d \(max \d\) \S+ tok/s",
            line,
        ), line
        assert f"loss {rec['loss']:.4g}" in line and f"kl {rec['kl']:.3g}" in line
        assert f"step {rec['step_time_s']:.2f} s" in line and f"lag {rec['policy_lag_mean']:.2f}" in line
    json.dumps(records)  # strict JSON throughout
