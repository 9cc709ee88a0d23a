"""Eval results reach metrics.jsonl while the trainer is the bottleneck (issue 29, point 3).

When the trainer is slower than the rest of the pipeline (every GPU run), the next step's
micro-batches are always buffered, so the trainer never waits for data; the eval log must not
depend on that wait. Here: the eval-log thread over a real ZeroMQ control channel writes results
during a long step while a flood of other control messages (three times the SUB's high-water
mark) passes by, and a real :class:`trainer.proc.TrainerProc` whose every step is buffered before
it starts writes each eval result, one log line per step, and never waits.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest

from lifecycle.launch_env import ENV_RESTARTS, ENV_RESUME
from bus.messages import EvalResult, RunDone, TrainerStep, new_id
from bus.topics import TOPICS
from tests.trainer.test_resume import WAIT_S, Packer, batches, read_jsonl, run_config, tiny_policy  # noqa: F401 - fixtures
from trainer.observability.eval_log import EvalLog
from trainer.observability.metrics_file import MetricsFile
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


def test_results_are_written_during_a_long_step_through_a_flood_beyond_the_high_water_mark(channel, tmp_path):
    """The "trainer" never touches the socket during its step; 3 x HWM other control messages and
    six eval results arrive meanwhile; all six are in metrics.jsonl before the step's record."""
    pub, sub = channel
    hwm = TOPICS["control_sub"].hwm
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    log = EvalLog(sub, metrics)
    log.start()
    try:
        with pytest.raises(RuntimeError, match="owns the socket"):
            log.poll()  # the thread owns it now
        sent = []
        flood = 3 * hwm
        for i in range(flood):
            assert pub.send(TrainerStep(id=new_id(), step=1, version=1, metrics={"loss": float(i)}))
            if i % (flood // 6) == flood // 12:
                sent.append((len(sent), "gsm8k"))
                assert pub.send(result(len(sent) - 1, "gsm8k", 0.5))
            if i % 500 == 499:
                time.sleep(0.02)  # ~20k messages/s: far more than a run's control traffic
        deadline = time.monotonic() + WAIT_S
        while len(log.written) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)  # the step goes on: the main thread reads nothing
        metrics.append({"step": 1, "loss": 0.25})
    finally:
        log.close()
    assert len(sent) == 6
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert eval_keys(tmp_path / "metrics.jsonl") == sent  # none dropped, each once, in order
    assert records[-1] == {"step": 1, "loss": 0.25}  # all of them before the step's own record


def test_a_trainer_that_never_waits_for_data_writes_every_eval_result_and_logs_every_step(
    tiny_policy, batches, tmp_path, monkeypatch, caplog
):
    """Every step's micro-batches are in the trainer's ledger before ``run()`` starts, so its wait
    loop never runs; eval round 0 is written before the run starts, round 2 while it runs, the
    final round 4 before ``run.done``; each step logs one line with loss, reward, KL, time, lag."""
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
        for mbs in batches:
            packer.send(mbs)
        deadline = time.monotonic() + WAIT_S
        while not all(proc.ledger.is_complete(s) for s in range(len(batches))):  # the whole run buffered
            assert time.monotonic() < deadline, f"buffered steps {proc.ledger.buffered_steps()}"
            proc.take_in(proc.batches.recv(timeout_s=0.1))

        def publish_until_written(rnd: int) -> None:
            deadline = time.monotonic() + WAIT_S
            while (rnd, "reverse_text") not in eval_keys(metrics_path):
                assert not errors, errors
                assert time.monotonic() < deadline, f"eval round {rnd} never reached metrics.jsonl"
                packer.publish.send(result(rnd, "reverse_text", 0.1 * rnd))  # repeated: the SUB may still be joining
                packer.control.recv(timeout_s=0.05)

        publish_until_written(0)  # nothing but the eval-log thread can write it: run() has not started

        def run() -> None:
            try:
                proc.run()
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        with caplog.at_level(logging.INFO, logger="trainer.proc"):
            runner = threading.Thread(target=run, daemon=True)
            runner.start()
            publish_until_written(2)
            publish_until_written(4)  # the final round: the trainer waits for it, then run.done
            packer.wait_for("run.done", lambda p: p.of_type(RunDone), Alive(errors))
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
    assert eval_keys(metrics_path) == [(0, "reverse_text"), (2, "reverse_text"), (4, "reverse_text")]
    assert records.index(next(r for r in records if "eval/reverse_text/reward_mean" in r)) == 0  # round 0 before step 1
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
