"""Each tracker, fed by the real follower from a hand-written run directory, read back through its
own library: loss, reward, learning rate, an eval round, per-stage throughput, the samples tables
and the config as hyperparameters; then a second follower (a restarted tracker process, or
``busctl up --resume``) continues from the saved offsets without logging anything twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trackers.tracked_run import (
    READERS,
    append,
    eval_record,
    make_run_dir,
    sample_records,
    stage_record,
    train_record,
)
from trackers.follower import TrackerFollower
from trackers.opening import tracker_lines

pytest.importorskip("tensorboard", reason="the trackers extra is not installed")


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_tracker_logs_what_the_run_files_hold(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip({"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name])
    for var in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no W&B key anywhere: offline by default
    run_dir = tmp_path / "run"
    config = make_run_dir(run_dir, [name])
    append(run_dir / "metrics.jsonl", train_record(1), train_record(2))
    append(run_dir / "eval.jsonl", eval_record(0))
    append(run_dir / "stages.jsonl", {"time": 1.0, "step": 0, "components": {}}, stage_record(1), stage_record(2))
    append(run_dir / "samples.jsonl", *sample_records(0))

    follower = TrackerFollower(run_dir, [name], config)
    assert [t.name for t in follower.trackers] == [name] and not follower.failed
    assert follower.poll() == 2 + 1 + 3 + 2  # records read: metrics, eval, stages, samples
    append(run_dir / "metrics.jsonl", train_record(3), "{not json\n", '{"step": 4, "loss"')  # the last line torn
    append(run_dir / "eval.jsonl", eval_record(2))
    append(run_dir / "samples.jsonl", *sample_records(2))
    follower.poll()
    assert follower.malformed == 1
    follower.close()

    resumed = TrackerFollower(run_dir, [name], config)  # offsets and the tracker's run id from trackers/state.json
    append(run_dir / "metrics.jsonl", ': 0.25, "reward_mean": 0.4, "lr": 0.0004}\n')  # the torn line completed
    resumed.poll()
    resumed.close()
    assert not resumed.failed, resumed.failed

    got = READERS[name](run_dir)  # the TensorBoard and MLflow readers fail on a tag logged twice at a step
    assert got["loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25})
    assert got["reward"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    assert got["lr"] == pytest.approx({1: 1e-4, 2: 2e-4, 3: 3e-4, 4: 4e-4})
    assert got["eval"] == pytest.approx({0: 0.30, 2: 0.32})  # eval rounds at their round, from eval.jsonl
    assert got["stage"] == pytest.approx({1: 10.0, 2: 20.0})
    assert got["tables"] == {0: ["sihT-0-0", "sihT-0-1"], 2: ["sihT-2-0", "sihT-2-1"]}
    assert got["lr_param"] == pytest.approx(config["trainer"]["optim"]["lr"])
    if name == "mlflow":
        assert got["lag_ge3"] == {1: 0.0, 2: 0.0, 3: 0.0}  # lag_frac/>=3 under an MLflow-legal name
        assert got["status"] == "FINISHED"
    if name == "wandb":  # one W&B row per logged record: nothing twice
        assert sorted(r["step"] for r in got["history"] if "loss" in r) == [1, 2, 3, 4]
    opening = {
        "tensorboard": f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}",
        "wandb": f"wandb (offline; uploads to your W&B account): wandb sync {run_dir / 'wandb'}/offline-run-",
        "mlflow": f"mlflow: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {run_dir / 'mlruns'}",
    }
    lines = tracker_lines(run_dir)  # what busctl report prints
    assert len(lines) == 1 and lines[0].startswith(opening[name]), lines


def test_failing_trackers_warn_once_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorBoard cannot create its directory (a file is in the way: like a full or read-only disk)
    and MLflow's server does not answer (no network): each is named in one warning and dropped; W&B
    is not installed in this process's view (its module hidden). The follower never raises and
    keeps reading the run's files."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # discard port: refused at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    run_dir = tmp_path / "run"
    config = make_run_dir(run_dir, ["tensorboard", "wandb", "mlflow"])
    (run_dir / "tensorboard").write_text("in the way")
    append(run_dir / "metrics.jsonl", train_record(1))
    with caplog.at_level("WARNING", logger="trackers.follower"):
        follower = TrackerFollower(run_dir, ["tensorboard", "wandb", "mlflow"], config)
        for step in (2, 3):
            append(run_dir / "metrics.jsonl", train_record(step))
            follower.poll()
        follower.close()
    assert follower.trackers == []
    assert set(follower.failed) == {"tensorboard", "wandb", "mlflow"}
    for name in follower.failed:
        assert sum(f"tracker {name} failed" in r.getMessage() for r in caplog.records) == 1, name
    assert follower.failed["wandb"].startswith("ModuleNotFoundError")
    assert follower.tails["metrics.jsonl"].offset == (run_dir / "metrics.jsonl").stat().st_size  # it kept reading

    (run_dir / "tensorboard").unlink()  # the disk fixed, a new tracker process (busctl up --resume): it works again
    again = TrackerFollower(run_dir, ["tensorboard"], config)
    assert [t.name for t in again.trackers] == ["tensorboard"] and "tensorboard" not in again.failed
    again.close()


def test_mlflow_samples_table_without_pandas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow-skinny does not install pandas (``log_table`` needs it): the table is the same JSON
    artifact, and the metrics are logged as ever."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_dir = tmp_path / "run"
    config = make_run_dir(run_dir, ["mlflow"])
    append(run_dir / "metrics.jsonl", train_record(1))
    append(run_dir / "samples.jsonl", *sample_records(0))
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)  # import pandas -> ImportError
    follower = TrackerFollower(run_dir, ["mlflow"], config)
    follower.poll()
    follower.close()
    assert not follower.failed, follower.failed
    monkeypatch.delitem(__import__("sys").modules, "pandas")
    got = READERS["mlflow"](run_dir)
    assert got["loss"] == {1: 1.0} and got["tables"] == {0: ["sihT-0-0", "sihT-0-1"]}
