"""What the trainer reports about its steps, in ``metrics.jsonl`` and on Prometheus: ``step_keys`` (the
one table of a step's metrics keys), ``gauges`` (the per-step series), ``step_timing`` (where a step's wall time
goes, phase by phase), ``lag_stats`` (the per-token off-policy lag of a step's loss tokens),
``step_log`` (per step: the gauges, the ``metrics.jsonl`` record and one log line), ``metrics_file``
(``metrics.jsonl`` appended from two threads under one lock) and ``eval_log`` (the ``eval.result``
messages of online evaluation, recorded per round and task by a thread of its own as they arrive).
"""
