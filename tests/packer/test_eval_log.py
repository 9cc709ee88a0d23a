"""Tests for packer.eval_log and runfiles.eval_records: an eval result's eval.jsonl record, written
once per (round, task) also across a restart, the records a resume keeps, a line cut short, and the
``rlbus_eval_*`` gauges (the pass@k series exist from the start)."""

from __future__ import annotations

import json

from prometheus_client import REGISTRY

from bus.messages import EvalResult, new_id
from configs.schema import load_config
from packer.eval_log import EvalLog, declare_pass_at_k
from runfiles.eval_records import eval_record, keep_eval_records, read_evals, record_evals


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


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    assert record_evals(eval_record(r)) == {(2, "gsm8k")} and record_evals({"step": 1, "loss": 0.5}) == set()


def test_results_are_written_once_per_round_and_task(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(eval_record(result(0, "gsm8k", 0.1))) + "\n")
    log = EvalLog(path)
    assert log.written == {(0, "gsm8k")}  # read back from eval.jsonl (a restarted packer)
    written = [
        log.write(r)
        for r in (
            result(0, "gsm8k", 0.9),
            result(2, "gsm8k", 0.3),
            result(2, "countdown", 0.4),
            result(2, "gsm8k", 0.8),
        )
    ]
    assert written == [False, True, True, False]
    assert EvalLog(path).write(result(2, "countdown", 0.7)) is False  # also after another restart
    assert [(r["step"], r.get("eval/gsm8k/reward_mean"), r.get("eval/countdown/reward_mean")) for r in lines(path)] == [
        (0, 0.1, None),
        (2, 0.3, None),
        (2, None, 0.4),
    ]


def test_a_resume_keeps_the_rounds_its_checkpoint_covers_and_a_restart_keeps_all(tmp_path):
    path = tmp_path / "eval.jsonl"
    records = [eval_record(result(r, t, 0.5)) for r, t in ((0, "gsm8k"), (4, "gsm8k"), (4, "countdown"), (6, "gsm8k"))]
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    # a supervisor restart keeps every record (nothing would evaluate those rounds again)
    assert EvalLog(path).written == {(0, "gsm8k"), (4, "gsm8k"), (4, "countdown"), (6, "gsm8k")}
    assert path.read_text() == text
    # busctl up --resume from checkpoint step 4: rounds <= 4 stay, round 6 evaluated the lost lineage
    log = EvalLog(path, keep_through=4)
    assert log.written == {(0, "gsm8k"), (4, "gsm8k"), (4, "countdown")}
    assert lines(path) == records[:3]
    assert log.write(result(6, "gsm8k", 0.9))  # evaluated again when the policy reaches it
    assert keep_eval_records(tmp_path / "missing.jsonl", 4) == 0


def test_a_last_line_cut_short_is_dropped_before_appending(tmp_path):
    path = tmp_path / "eval.jsonl"
    whole = json.dumps(eval_record(result(0, "gsm8k", 0.1))) + "\n"
    path.write_text(whole + json.dumps(eval_record(result(2, "gsm8k", 0.2)))[:20])  # the packer died mid-write
    assert read_evals(path) == {(0, "gsm8k")}
    log = EvalLog(path)
    assert log.write(result(2, "gsm8k", 0.2))
    assert [r["step"] for r in lines(path)] == [0, 2]


def test_the_gauges_show_the_last_round(tmp_path):
    log = EvalLog(tmp_path / "eval.jsonl")
    value = lambda name, **labels: REGISTRY.get_sample_value(name, {"task": "gauged", **labels})
    assert log.write(result(1, "gauged", 0.25, pass_at_2=0.0))
    r = result(3, "gauged", 0.75, reward_std=0.1, completion_len_mean=3.0, pass_at_2=0.5, **{"reward/lcs": 0.25})
    assert log.write(r)
    assert not log.write(result(3, "gauged", 0.0))  # a repeat changes nothing
    assert (value("rlbus_eval_reward_mean"), value("rlbus_eval_round"), value("rlbus_eval_num_failed")) == (0.75, 3, 1)
    assert (value("rlbus_eval_reward_std"), value("rlbus_eval_completion_len_mean")) == (0.1, 3.0)
    assert value("rlbus_eval_pass_at_k", k="2") == 0.5
    assert value("rlbus_eval_reward_term_mean", reward="lcs") == 0.25


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
