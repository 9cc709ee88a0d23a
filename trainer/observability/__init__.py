"""What the trainer reports about its steps, in ``metrics.jsonl`` and on Prometheus: ``gauges`` (the
per-step series: step time, loss statistics, rewards), ``step_timing`` (where a step's wall time
goes, phase by phase), ``lag_stats`` (the per-token off-policy lag of a step's loss tokens) and
``eval_log`` (the ``eval.result`` messages of online evaluation, recorded per round and task).
"""
