"""What the trainer reports about its steps, in ``metrics.jsonl`` and on Prometheus: ``step_keys`` (the
one table of a step's metrics keys), ``gauges`` (the per-step series), ``step_timing`` (where a step's wall time
goes, phase by phase), ``lag_stats`` (the per-token off-policy lag of a step's loss tokens),
and ``step_log`` (per step: the gauges, the ``metrics.jsonl`` record and one log line).
"""
