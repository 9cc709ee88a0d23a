"""MLflow: one MLflow run per rlbus run, through :class:`mlflow.tracking.MlflowClient`.

Store: ``MLFLOW_TRACKING_URI`` when set, else a file store at ``RUN_DIR/mlruns/`` (MLflow 3 keeps it behind
``MLFLOW_ALLOW_FILE_STORE=true``, which the tracker sets for its own process). Experiment:
``MLFLOW_EXPERIMENT_NAME`` or the config's ``name``; the run id is kept in the tracker state for ``--resume``.
Params cut at :data:`PARAM_CHARS`; metric names made legal by :func:`metric_name`; samples as a table artifact.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from trackers.base import Tracker

__all__ = ["MlflowTracker", "metric_name"]

PARAM_CHARS = 6000
"""MLflow's longest param value (characters); longer config values are cut."""

BATCH = 100
"""Params per ``log_batch`` call (MLflow accepts at most 100 params, 1000 metrics per call)."""

_ILLEGAL = re.compile(r"[^\w\-./ :]")


def metric_name(key: str) -> str:
    """``key`` with the characters MLflow refuses replaced: ``>=`` -> ``ge``, ``<=`` -> ``le``, others -> ``_``
    (``lag_frac/>=3`` -> ``lag_frac/ge3``)."""
    return _ILLEGAL.sub("_", key.replace(">=", "ge").replace("<=", "le"))


class MlflowTracker(Tracker):
    """Logs the run's records to an MLflow run; ImportError without mlflow, ``MlflowException`` when the store
    refuses the experiment or run."""

    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict, state: dict) -> None:
        super().__init__(run_dir, config, state)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        run_id = state.get("run_id")
        if not run_id:
            exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or str(config.get("name") or "rlbus")
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
            run_id = self.client.create_run(
                exp_id, run_name=run_dir.name, tags={"rlbus.run_dir": str(run_dir)}
            ).info.run_id
        else:
            self.client.update_run(
                run_id, status="RUNNING"
            )  # resumed: it was set FINISHED when the tracker process ended
        self.run_id = self.state["run_id"] = run_id
        self.state["tracking_uri"] = uri  # for trackers.opening (busctl report)

    def log_config(self, hparams: dict[str, str | int | float | bool]) -> None:
        params = [self._param(metric_name(k), str(v)[:PARAM_CHARS]) for k, v in hparams.items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(metric_name(k), v, now_ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_samples(self, step: int, columns: tuple[str, ...], rows: list[list]) -> None:
        path = f"samples/step_{step:06d}.json"
        try:
            import pandas  # noqa: F401  (MlflowClient.log_table needs it; mlflow-skinny does not install it)
        except ImportError:  # the same {"columns", "data"} JSON, without the Evaluation view's table tags
            self.client.log_dict(self.run_id, {"columns": list(columns), "data": rows}, path)
            return
        data = {col: [row[i] for row in rows] for i, col in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=path)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
