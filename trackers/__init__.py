"""Experiment trackers (``report.trackers``): TensorBoard, Weights & Biases, MLflow.

One process (``python -m trackers``, started and stopped by ``busctl up``) follows the run's JSONL files and logs
what they gain to each tracker through its own library; nothing here runs in a pipeline component. The design is
in docs/ARCHITECTURE.md, "Observability".
"""
