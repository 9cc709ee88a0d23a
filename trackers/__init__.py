"""Experiment trackers (``report.trackers``): TensorBoard, Weights & Biases, MLflow.

A process of its own (``python -m trackers``, started and stopped by ``busctl up`` through
:mod:`trackers.launch`) follows the run directory's ``metrics.jsonl`` (step records and eval
rounds), ``stages.jsonl`` (per-stage throughput) and ``samples.jsonl`` (examples) and logs what
they gain to each tracker, through each tracker's own library:

- :mod:`trackers.records`: what is logged, pure functions over the records; the byte-offset tail.
- :mod:`trackers.follower`: the follow loop, its resumable state, the warn-once-and-drop policy.
- :mod:`trackers.state`: ``RUN_DIR/trackers/state.json``, its one reader (a torn file reads as empty) and writer.
- :mod:`trackers.tensorboard_tracker`, :mod:`trackers.wandb_tracker`, :mod:`trackers.mlflow_tracker`:
  one module per tracker (:class:`trackers.base.Tracker`).

Nothing here runs in a pipeline component: the trainer's hot path only appends to metrics.jsonl.
"""
