"""A hand-written run directory for the tracker tests, and readers that get back what each tracker
logged through the tracker's own library: TensorBoard's ``EventAccumulator``, W&B's offline run
files (:mod:`tests.trackers.wandb_files`), ``mlflow.tracking.MlflowClient``."""

from __future__ import annotations

import json
from pathlib import Path

from configs.schema import RunConfig, dump_config
from tests.trackers import wandb_files

RUN_NAME = "tracked"


def make_run_dir(run_dir: Path, trackers: list[str]) -> dict:
    """Write ``config.yaml`` naming ``trackers``; returns the config as the tracker process reads it."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig(name=RUN_NAME, run_dir=str(run_dir), report={"trackers": trackers, "samples_interval": 2})
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def append(path: Path, *records: dict | str) -> None:
    """Append records (dicts as JSON lines; a str as it is, e.g. a torn or malformed line)."""
    with path.open("a") as f:
        for rec in records:
            f.write(rec if isinstance(rec, str) else json.dumps(rec) + "\n")


def train_record(step: int) -> dict:
    """A metrics.jsonl step record whose values follow from ``step``."""
    return {
        "step": step,
        "loss": 1.0 / step,
        "reward_mean": 0.1 * step,
        "kl": 0.001 * step,
        "entropy": 2.0 - 0.1 * step,
        "policy_lag_mean": 0.5,
        "lr": 1e-4 * step,
        "time/forward_s": 0.25,
        "lag_frac/>=3": 0.0,
    }


def eval_record(round_: int) -> dict:
    """An eval.jsonl record of task reverse_text at ``round_``."""
    return {"step": round_, "eval/reverse_text/reward_mean": 0.3 + 0.01 * round_, "eval/reverse_text/num_samples": 16}


def stage_record(step: int) -> dict:
    """A stages.jsonl record: one producer's throughput at ``step``."""
    return {
        "time": 1.0,
        "step": step,
        "components": {
            "producer-0": {
                "role": "producer",
                "throughput": {"samples_per_s": 10.0 * step, "tokens_per_s": 90.0 * step},
                "busy": 0.5,
                "queue_depth": 1.0,
            }
        },
    }


def sample_records(step: int, n: int = 2) -> list[dict]:
    """``n`` samples.jsonl examples of ``step`` (a ``|`` and a newline in the prompt on purpose)."""
    return [
        {
            "step": step,
            "time": 1.0,
            "group_id": f"g{step}",
            "task": "reverse_text",
            "sample": i,
            "group_size": n,
            "prompt": "reverse | this\nplease",
            "completion": f"sihT-{step}-{i}",
            "reward": 0.25 * i,
            "advantage": 0.5 - i,
            "policy_version": step,
            "lag": 0,
            "finish_reason": "stop",
            "completion_tokens": 5,
        }
        for i in range(n)
    ]


# -- readers, one per tracker: {"loss": {step: value}, "eval": {round: value}, "tables": {step: [completions]},
#    "lr_param": ...}


def read_tensorboard(run_dir: Path) -> dict:
    """What RUN_DIR/tensorboard holds, read event by event from every event file (a resumed tracker
    writes a new one) with TensorBoard's event file loader; fails if a tag was logged twice at a
    step (``EventAccumulator`` would keep one of them, or purge the older ones)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    logged: dict[str, dict[int, list]] = {}  # tag -> step -> the summary values logged
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                logged.setdefault(value.tag, {}).setdefault(event.step, []).append(value)

    def once(tag: str) -> dict:
        by_step = logged.get(tag, {})
        twice = {step: len(values) for step, values in by_step.items() if len(values) > 1}
        assert not twice, f"{tag} logged more than once at a step ({{step: count}}): {twice}"
        return {step: values[0] for step, values in by_step.items()}

    def scalars(tag: str) -> dict[int, float]:
        return {step: value.tensor.float_val[0] for step, value in once(tag).items()}

    tables = {
        step: [line.split(" | ")[5] for line in value.tensor.string_val[0].decode().split("\n")[2:]]  # completions
        for step, value in once("samples/text_summary").items()
    }
    (start,) = once("_hparams_/session_start_info").values()
    hp = plugin_data_pb2.HParamsPluginData.FromString(start.metadata.plugin_data.content)
    return {
        "loss": scalars("loss"),
        "reward": scalars("reward_mean"),
        "lr": scalars("lr"),
        "eval": scalars("eval/reverse_text/reward_mean"),
        "stage": scalars("stages/producer-0/samples_per_s"),
        "tables": tables,
        "lr_param": hp.session_start_info.hparams["trainer.optim.lr"].number_value,
    }


def read_wandb(run_dir: Path) -> dict:
    """What the W&B offline run under RUN_DIR/wandb holds, read from its run files."""
    rows = wandb_files.history(run_dir)

    def series(key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in rows if key in r}

    tables = {}
    for r in rows:
        if r.get("samples/_type") == "table-file":
            table = json.loads((r["_files"] / r["samples/path"]).read_text())
            col = table["columns"].index("completion")
            tables[r["step"]] = [row[col] for row in table["data"]]
    config = wandb_files.config(run_dir)
    return {
        "loss": series("loss"),
        "reward": series("reward_mean"),
        "lr": series("lr"),
        "eval": series("eval/reverse_text/reward_mean"),
        "stage": series("stages/producer-0/samples_per_s"),
        "tables": tables,
        "lr_param": config["trainer"]["optim"]["lr"],
        "history": rows,
    }


def read_mlflow(run_dir: Path) -> dict:
    """What the MLflow file store RUN_DIR/mlruns holds, read with ``MlflowClient``."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    exp = client.get_experiment_by_name(RUN_NAME)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run_id = runs[0].info.run_id

    def series(key: str) -> dict[int, float]:
        history = client.get_metric_history(run_id, key)
        assert len({m.step for m in history}) == len(history), f"{key} logged twice at a step: {history}"
        return {m.step: m.value for m in history}

    tables = {}
    for art in client.list_artifacts(run_id, "samples"):
        table = json.loads(Path(client.download_artifacts(run_id, art.path, str(run_dir / "downloaded"))).read_text())
        col = table["columns"].index("completion")
        tables[int(art.path.rsplit("_", 1)[1].split(".")[0])] = [row[col] for row in table["data"]]
    return {
        "loss": series("loss"),
        "reward": series("reward_mean"),
        "lr": series("lr"),
        "eval": series("eval/reverse_text/reward_mean"),
        "stage": series("stages/producer-0/samples_per_s"),
        "tables": tables,
        "lr_param": float(runs[0].data.params["trainer.optim.lr"]),
        "lag_ge3": series("lag_frac/ge3"),
        "status": client.get_run(run_id).info.status,
    }


READERS = {"tensorboard": read_tensorboard, "wandb": read_wandb, "mlflow": read_mlflow}
