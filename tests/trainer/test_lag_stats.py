"""Loss tokens per off-policy lag (trainer.observability.lag_stats) in a real Trainer step on a tiny Qwen2 model:
a partial rollout's tokens count at their own lags, fractions sum to 1, the on-policy logprob check
covers exactly the tokens of the trained version, and the Prometheus gauge follows."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from prometheus_client import REGISTRY

from tests.trainer.test_trainer import micro_batches, policy, samples, trainer_cfg
from trainer.observability.gauges import export_step_metrics
from trainer.observability.lag_stats import lag_fractions
from trainer.trainer import Trainer

STEP = 3


def with_versions(g, completion_versions: list[int]):
    """The single-sample group ``g`` with its completion tokens sampled at ``completion_versions``
    (run-length version spans, as a partial rollout's; the prompt carries the oldest)."""
    spans = [[v, len(list(run))] for v, run in itertools.groupby(completion_versions)]
    return dataclasses.replace(
        g,
        version_start=np.array([min(completion_versions)], np.int64),
        version_end=np.array([max(completion_versions)], np.int64),
        version_spans=np.array(spans, np.int64),
        version_span_counts=np.array([len(spans)], np.int32),
    )


def test_lag_fractions_of_a_step(model_dir):
    """SPECS completions of 4, 3, 2, 5 tokens, trained at step 3: sample 0 at version 3 (lag 0),
    sample 1 a partial rollout over versions 1, 2, 3 (lags 2, 1, 0), sample 2 at version 0 (lag 3,
    bucket '>=3'), sample 3 at version 2 (lag 1): lag 0: 5, lag 1: 6, lag 2: 1, >=3: 2 of 14."""
    model = policy(model_dir, lora=False)
    ss = samples(model)
    ss = [
        with_versions(ss[0], [3] * 4),
        with_versions(ss[1], [1, 2, 3]),
        with_versions(ss[2], [0, 0]),
        with_versions(ss[3], [2] * 5),
    ]
    m = Trainer(model, trainer_cfg()).step(micro_batches(ss, [[0, 1], [2, 3]], step=STEP))
    assert {k: v for k, v in m.items() if k.startswith("lag_")} == pytest.approx(
        {"lag_frac/0": 5 / 14, "lag_frac/1": 6 / 14, "lag_frac/2": 1 / 14, "lag_frac/>=3": 2 / 14}
    )
    # the sampler logprobs are the model's own: the 5 tokens of version 3 agree
    assert m["onpolicy_tokens"] == 5 and m["onpolicy_lp_diff_max"] < 1e-5
    export_step_metrics(STEP + 1, {**m, "step_time_s": 1.0})
    assert REGISTRY.get_sample_value("rlbus_trainer_lag_token_frac", {"lag": "1"}) == pytest.approx(6 / 14)
    assert REGISTRY.get_sample_value("rlbus_trainer_lag_token_frac", {"lag": ">=3"}) == pytest.approx(2 / 14)


def test_no_loss_tokens_reports_no_fractions():
    assert lag_fractions({"lag_tokens/0": 0.0, "lag_tokens/1": 0.0, "lag_tokens/2": 0.0, "lag_tokens/>=3": 0.0}) == {}
    totals = {"lag_tokens/1": 2.0, "loss": 1.0}
    assert lag_fractions(totals) == {"lag_frac/0": 0.0, "lag_frac/1": 1.0, "lag_frac/2": 0.0, "lag_frac/>=3": 0.0}
    assert totals == {"loss": 1.0}  # the counts are consumed
