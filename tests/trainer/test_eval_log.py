"""Tests for trainer.observability.eval_log: eval results from a real control channel (an XPUB bound here, as
the hub's, and the trainer's SUB) to metrics.jsonl records, once per (round, task); the wait for
the final round; and which records survive a resume."""

from __future__ import annotations

import json
import threading
import time

from prometheus_client import REGISTRY

from bus.messages import EvalResult, TrainerStep, new_id
from configs.schema import load_config
from trainer.observability.eval_log import EvalLog, declare_pass_at_k, eval_record, keep_metrics_record
from trainer.observability.metrics_file import MetricsFile


def result(rnd: int, task: str, reward: float, **metrics: float) -> EvalResult:
    return EvalResult(
        id=new_id(),
        round=rnd,
        task=task,
        version_min=rnd,
        version_max=rnd + 1,
        num_samples=6,
        num_failed=1,
        metrics={"reward_mean": reward, **metrics},
    )


def test_eval_record_by_hand():
    r = result(2, "gsm8k", 0.5, pass_at_4=0.75, **{"reward/gsm8k": 0.5})
    assert eval_record(r) == {
        "step": 2,
        "eval/gsm8k/num_samples": 6,
        "eval/gsm8k/num_failed": 1,
        "eval/gsm8k/version_min": 2,
        "eval/gsm8k/version_max": 3,
        "eval/gsm8k/reward_mean": 0.5,
        "eval/gsm8k/pass_at_4": 0.75,
        "eval/gsm8k/reward/gsm8k": 0.5,
    }


def test_results_are_written_once_per_round_and_task(channel, tmp_path):
    pub, sub = channel
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 1, "loss": 0.5}) + "\n" + json.dumps(eval_record(result(0, "gsm8k", 0.1))) + "\n"
    )
    log = EvalLog(sub, MetricsFile(path))
    assert log.written == {(0, "gsm8k")}  # read back from metrics.jsonl (a resumed trainer)
    for msg in (
        result(0, "gsm8k", 0.9),
        TrainerStep(id=new_id(), step=1, version=1, metrics={}),
        result(2, "gsm8k", 0.3),
        result(2, "countdown", 0.4),
        result(2, "gsm8k", 0.8),
    ):
        assert pub.send(msg)
    deadline = time.monotonic() + 10
    while len(log.written) < 3 and time.monotonic() < deadline:
        log.poll(timeout_s=0.1)
    log.poll(timeout_s=0.2)  # the repeat of (2, gsm8k) too
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r.get("eval/gsm8k/reward_mean"), r.get("eval/countdown/reward_mean")) for r in records] == [
        (1, None, None),
        (0, 0.1, None),
        (2, 0.3, None),
        (2, None, 0.4),
    ]


def test_wait_for_round(channel, tmp_path):
    pub, sub = channel
    log = EvalLog(sub, MetricsFile(tmp_path / "metrics.jsonl"))
    stop = threading.Event()
    sender = threading.Timer(0.3, lambda: [pub.send(result(4, t, 0.5)) for t in ("a", "b")])
    sender.start()
    started = time.monotonic()
    assert log.wait_for_round(4, ["a", "b"], timeout_s=10.0, stop=stop) == []
    assert 0.2 < time.monotonic() - started < 5.0  # returned as soon as both were in
    sender.join()
    started = time.monotonic()
    assert log.wait_for_round(6, ["a", "b"], timeout_s=0.5, stop=stop) == ["a", "b"]
    assert time.monotonic() - started >= 0.5
    stop.set()
    started = time.monotonic()
    assert log.wait_for_round(8, ["a"], timeout_s=30.0, stop=stop) == ["a"]  # a stop ends the wait
    assert time.monotonic() - started < 1.0


def test_keep_metrics_record_after_a_resume():
    # checkpoint at step 4: training records {"step": s + 1} of steps 0..3 and eval rounds <= 4 stay
    assert keep_metrics_record({"step": 4, "loss": 1.0}, 4)
    assert keep_metrics_record({"step": 4, "eval/gsm8k/reward_mean": 0.5}, 4)
    assert keep_metrics_record({"step": 0, "eval/gsm8k/reward_mean": 0.5}, 4)
    assert not keep_metrics_record({"step": 5, "loss": 1.0}, 4)
    assert not keep_metrics_record({"step": 6, "eval/gsm8k/reward_mean": 0.5}, 4)  # the lost lineage
    # a supervisor restart keeps every eval record (nothing would evaluate those rounds again)
    assert keep_metrics_record({"step": 6, "eval/gsm8k/reward_mean": 0.5}, 4, resume=False)
    assert not keep_metrics_record({"step": 6, "loss": 1.0}, 4, resume=False)


def pass_at_k(task: str, k: str) -> float | None:
    return REGISTRY.get_sample_value("rlbus_eval_pass_at_k", {"task": task, "k": k})


def test_the_pass_at_k_series_of_the_configured_eval_tasks_exist_at_0_from_the_start():
    cfg = load_config(None, ["eval.tasks=[{name: declared_a, rollouts_per_example: 4}, {name: declared_b}]"])
    declare_pass_at_k(cfg)
    assert pass_at_k("declared_a", "4") == 0.0
    assert pass_at_k("declared_b", "1") == 0.0  # one completion per example: pass@1
    default = load_config(None, ["task.name=countdown", "eval.tasks=[]"])  # no eval tasks: the training task stands in
    declare_pass_at_k(default)
    assert pass_at_k("countdown", "1") == 0.0
    off = load_config(None, ["eval.enabled=false", "eval.tasks=[{name: declared_off, rollouts_per_example: 2}]"])
    declare_pass_at_k(off)
    assert pass_at_k("declared_off", "2") is None
