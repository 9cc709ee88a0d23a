"""A trainer step's statistics: what each micro-batch contributes, and the step's metrics from their
totals. A micro-batch contributes sums and ``_min``/``_max`` values, so they merge over micro-batches
and ranks (:func:`merge_stats`); its counts come from its host arrays (:func:`host_micro_stats`),
its loss statistics stay on the device until the step reads them all back at once (:func:`read_back`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bus.messages import MicroBatch
from trainer.observability.lag_stats import lag_fractions, lag_token_counts

__all__ = ["REWARD_TERM_PREFIX", "host_micro_stats", "merge_stats", "read_back", "reward_term_stats", "step_metrics"]


def host_micro_stats(mb: MicroBatch) -> dict[str, float]:
    """The stats of one micro-batch that its host arrays give: token, sample and micro-batch counts,
    float64 reward sums and squares, ``reward_terms/<name>/sum`` and ``/count``, ``onpolicy_tokens``
    (loss tokens with ``token_versions == step``) and ``lag_tokens/<bucket>``."""
    rewards = np.asarray(mb.rewards, dtype=np.float64)
    mask = np.asarray(mb.loss_mask, dtype=bool)
    versions = np.asarray(mb.token_versions, dtype=np.int64)
    return {
        "num_tokens": float(len(mb.input_ids)),
        "num_micro_batches": 1.0,
        "num_samples": float(len(rewards)),
        "reward_sum": float(rewards.sum()),
        "reward_sq_sum": float((rewards**2).sum()),
        "onpolicy_tokens": float((mask & (versions == mb.step)).sum()),
        **reward_term_stats(mb.reward_terms),
        **lag_token_counts(versions, mask, mb.step),
    }


def read_back(device_stats: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Every micro-batch's device stats (``{name: 0-dim tensor}``) as floats, with ONE host sync
    (one stack of all values, one ``tolist``); same order and keys."""
    flat = [value.double().reshape(()) for stats in device_stats for value in stats.values()]
    values = iter(torch.stack(flat).tolist() if flat else [])
    return [{name: next(values) for name in stats} for stats in device_stats]


REWARD_TERM_PREFIX = "reward_terms/"
"""Stats keys ``reward_terms/<name>/sum`` and ``/count`` (not ending in ``_min``/``_max``, so
:func:`merge_stats` sums them whatever the reward function's name)."""


def reward_term_stats(reward_terms: dict[str, list[float]]) -> dict[str, float]:
    """Per-function sums and counts of one micro-batch's ``reward_terms`` ({name: [S] scores})."""
    stats = {}
    for name, scores in reward_terms.items():
        stats[f"{REWARD_TERM_PREFIX}{name}/sum"] = float(np.sum(np.asarray(scores, np.float64)))
        stats[f"{REWARD_TERM_PREFIX}{name}/count"] = float(len(scores))
    return stats


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Merge two micro-batch (or rank) stats: ``_min`` keys take the minimum, ``_max`` the
    maximum, the rest add; a key on one side only is kept. Returns a new dict."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key.endswith("_min"):
            out[key] = min(out[key], value)
        elif key.endswith("_max"):
            out[key] = max(out[key], value)
        else:
            out[key] = out[key] + value
    return out


def step_metrics(totals: dict[str, float], grad_norm: float, train_time_s: float, *, skipped: bool) -> dict[str, float]:
    """The metrics of :meth:`Trainer.step` (keys: :data:`trainer.observability.step_keys.STEP_KEYS`)
    from the step's merged stats. Per-token means divide by the loss tokens (at least 1); rewards
    ``mean = S1 / n``, ``std = sqrt(max(S2 / n - mean**2, 0))`` from float64 sums (NaN without
    samples); ``reward/<name>`` averages over the samples that carry that function's score."""
    t = dict(totals)
    n_loss = max(t.get("loss_tokens", 0.0), 1.0)
    n = t.pop("num_samples", 0.0)
    s1, s2 = t.pop("reward_sum", 0.0), t.pop("reward_sq_sum", 0.0)
    reward_mean = s1 / n if n else math.nan
    reward_std = math.sqrt(max(s2 / n - reward_mean**2, 0.0)) if n else math.nan
    metrics = {
        "loss": t.pop("loss", 0.0),
        "kl": t.pop("kl_sum", 0.0) / n_loss,
        "masked_frac": t.pop("masked_tokens", 0.0) / n_loss,
        "importance_ratio_mean": t.pop("ratio_sum", 0.0) / n_loss,
        "importance_ratio_min": t.pop("ratio_min", math.inf),
        "importance_ratio_max": t.pop("ratio_max", -math.inf),
        "clipfrac": t.pop("clipped_tokens", 0.0) / n_loss,
        "entropy": t.pop("entropy_sum", 0.0) / n_loss,
        "grad_norm": grad_norm,
        "num_tokens": t.pop("num_tokens", 0.0),
        "num_loss_tokens": t.pop("loss_tokens", 0.0),
        "num_samples": n,
        "num_micro_batches": t.pop("num_micro_batches", 0.0),
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "onpolicy_tokens": t.pop("onpolicy_tokens", 0.0),
        "onpolicy_lp_diff_max": t.pop("onpolicy_lp_diff_max", 0.0),
        "train_time_s": train_time_s,
        "skipped": 1.0 if skipped else 0.0,
        **lag_fractions(t),
    }
    for key, total in (
        ("kl_penalty", "kl_penalty_sum"),
        ("teacher_kl", "teacher_kl_sum"),
        ("tis_clipfrac", "tis_clipped_tokens"),
    ):
        if total in t:  # reported only when the option is on
            metrics[key] = t.pop(total) / n_loss
    for key in sorted(k for k in t if k.startswith(REWARD_TERM_PREFIX) and k.endswith("/sum")):
        name = key[len(REWARD_TERM_PREFIX) : -len("/sum")]
        count = t.pop(f"{REWARD_TERM_PREFIX}{name}/count", 0.0)
        metrics[f"reward/{name}"] = t.pop(key) / count if count else math.nan
    t.pop("non_finite_losses", None)
    t.pop("non_finite_grad_max", None)
    for key, value in t.items():  # further loss stats, as step totals
        metrics.setdefault(key, value)
    return metrics
