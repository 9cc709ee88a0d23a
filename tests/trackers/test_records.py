"""trackers.records: the byte-offset tail of the run's JSONL files and what each record becomes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trackers.mlflow_tracker import metric_name
from trackers.records import SAMPLE_COLUMNS, JsonlTail, flatten_config, sample_row, split_metrics_record, stage_scalars


def test_tail_reads_whole_lines_once_and_resumes_from_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # no file yet
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')  # the second line is still being written
    assert tail.read() == [{"step": 1}]
    assert tail.read() == []
    with path.open("a") as f:
        f.write('ss": 0.5}\nnot json\n[1, 2]\n')
    assert tail.read() == [{"step": 2, "loss": 0.5}]
    assert tail.malformed == 2  # a non-JSON line and a JSON non-object, dropped
    with path.open("a") as f:
        f.write(json.dumps({"step": 3}) + "\n")
    again = JsonlTail(path, offset=tail.offset)  # a restarted follower continues where this one stopped
    assert again.read() == [{"step": 3}]
    path.write_text(json.dumps({"step": 9}) + "\n")  # rewritten shorter: read again from the start
    assert again.read() == [{"step": 9}]


def test_tail_of_a_file_rewritten_by_resume_returns_only_the_new_records(tmp_path: Path) -> None:
    """busctl up --resume from a checkpoint at step 2: the trainer replaces metrics.jsonl (a new
    inode) keeping the records of steps <= 2, then appends the steps it trains again; a tail that
    had read steps 1-3 (a restarted one as well) returns only the re-trained step 3 and later."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(lines))
    tail = JsonlTail(path)
    assert [r["step"] for r in tail.read()] == [1, 2, 3]
    restarted = JsonlTail(path, offset=tail.offset)
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_text("".join(lines[:2]) + json.dumps({"step": 3, "loss": 0.3}) + "\n")  # longer than before, other values
    tmp.replace(path)
    assert tail.read() == [{"step": 3, "loss": 0.3}]
    assert restarted.read() == [{"step": 3, "loss": 0.3}]
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "loss": 0.5}) + "\n")  # same bytes as a kept line, appended: new, returned
    assert tail.read() == [{"step": 2, "loss": 0.5}]
    with pytest.raises(ValueError, match="offset"):
        JsonlTail(path, offset=-1)


def test_metrics_records_split_into_training_steps_and_eval_rounds() -> None:
    train = {
        "step": 3,
        "loss": -0.1,
        "reward_mean": 0.4,
        "lag_frac/>=3": 0.0,
        "lr": 1e-4,
        "skipped": False,
        "note": "x",
        "kl": float("nan"),
    }
    assert split_metrics_record(train) == (
        "train",
        3,
        {"loss": -0.1, "reward_mean": 0.4, "lag_frac/>=3": 0.0, "lr": 1e-4},
    )
    evalrec = {"step": 2, "eval/reverse_text/reward_mean": 0.5, "eval/reverse_text/num_samples": 16}
    assert split_metrics_record(evalrec) == (
        "eval",
        2,
        {"eval/reverse_text/reward_mean": 0.5, "eval/reverse_text/num_samples": 16.0},
    )
    for bad in (
        {"loss": 1.0},
        {"step": "3", "loss": 1.0},
        {"step": -1, "loss": 1.0},
        {"step": True, "loss": 1.0},
        {"step": 1},
    ):
        assert split_metrics_record(bad) is None, bad


def test_stage_records_become_per_component_scalars() -> None:
    rec = {
        "time": 1.0,
        "step": 4,
        "components": {
            "producer-0": {
                "role": "producer",
                "throughput": {"samples_per_s": 20.0, "tokens_per_s": 180.5},
                "busy": 0.25,
                "queue_depth": 0.0,
            },
            "hub": {
                "role": "hub",
                "throughput": {"samples_per_s": None, "tokens_per_s": None},
                "busy": None,
                "queue_depth": None,
            },
        },
    }
    assert stage_scalars(rec) == (
        4,
        {
            "stages/producer-0/samples_per_s": 20.0,
            "stages/producer-0/tokens_per_s": 180.5,
            "stages/producer-0/busy": 0.25,
            "stages/producer-0/queue_depth": 0.0,
        },
    )
    assert stage_scalars({"step": 1, "components": {"hub": rec["components"]["hub"]}}) is None
    assert stage_scalars({"step": 1}) is None


def test_sample_rows_and_flat_hyperparameters() -> None:
    step, row = sample_row({"step": 10, "task": "t", "prompt": "p", "completion": "c", "reward": 0.5, "extra": 1})
    assert step == 10 and len(row) == len(SAMPLE_COLUMNS)
    assert dict(zip(SAMPLE_COLUMNS, row)) == {
        **dict.fromkeys(SAMPLE_COLUMNS),
        "step": 10,
        "task": "t",
        "prompt": "p",
        "completion": "c",
        "reward": 0.5,
    }
    assert sample_row({"task": "t"}) is None
    flat = flatten_config(
        {"name": "r", "trainer": {"optim": {"lr": 1e-4}, "lora": {"targets": ["q", "v"]}}, "x": None, "e": {}}
    )
    assert flat == {"name": "r", "trainer.optim.lr": 1e-4, "trainer.lora.targets": '["q", "v"]', "x": "null", "e": "{}"}


def test_mlflow_metric_names_are_legal() -> None:
    assert metric_name("lag_frac/>=3") == "lag_frac/ge3"
    assert metric_name("eval/reverse_text/pass_at_4") == "eval/reverse_text/pass_at_4"
    assert metric_name("a{b}=c") == "a_b__c"


def test_markdown_table_keeps_one_row_per_line() -> None:
    """TensorBoard's samples text: a completion with ``|`` and any line break (the tiny policy's
    byte tokenizer emits form feeds and U+2028 too) stays in its cell."""
    from trackers.tensorboard_tracker import markdown_table

    text = markdown_table(("completion", "reward"), [["x|y\nz\x0cw\r\nq\u2028", 1.23456], ["", None]])
    assert text.split("\n") == [
        "| completion | reward |",
        "|---|---|",
        "| x\\|y<br>z<br>w<br>q<br> | 1.235 |",
        "|  |  |",
    ]
    assert len(text.splitlines()) == 4
