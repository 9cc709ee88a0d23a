"""Per-sample array checks of the data messages, and per-token policy versions as run-length spans.

A completion sampled under several policy versions carries spans ``(version, num_tokens)`` in token order:
a group concatenates them into ``version_spans [M, 2] int64`` with ``version_span_counts [G] int32`` rows per
sample; a micro-batch carries them expanded, ``token_versions [T] int64``. A group's spans are absent (both
empty: every token counts as ``version_start``, the oldest) or complete: they cover each sample's completion
tokens exactly and their min / max are ``version_start`` / ``version_end``. Versions need not rise: a
resumed trainer rolls the policy back (docs/ARCHITECTURE.md, "Pace, staleness and accounting").
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from bus.wire import WireError, check_terms

# bus.messages imports this module (its checks live here), so the message types are not imported
# back: parameters typed Any are a bus.messages.RolloutGroup (or ScoredGroup) or MicroBatch.
RolloutGroup = MicroBatch = Any


def run_lengths(versions: Sequence[int] | np.ndarray) -> np.ndarray:
    """Run-length encode per-token versions ``[L] int`` into spans ``[num_spans, 2] int64``."""
    v = np.asarray(versions, dtype=np.int64)
    if len(v) == 0:
        return np.zeros((0, 2), np.int64)
    starts = np.flatnonzero(np.concatenate([[True], v[1:] != v[:-1]]))
    lens = np.diff(np.concatenate([starts, [len(v)]]))
    return np.stack([v[starts], lens], axis=1).astype(np.int64)


def pack_spans(per_sample: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's spans ``[n_j, 2]`` -> ``(version_spans [M, 2] int64, version_span_counts [G] int32)``."""
    spans = [np.asarray(s, np.int64).reshape(-1, 2) for s in per_sample]
    counts = np.array([len(s) for s in spans], dtype=np.int32)
    return (np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)), counts


def sample_token_versions(group: RolloutGroup, j: int) -> np.ndarray:
    """``[L_j] int64`` version of each completion token of sample ``j`` (no spans: ``version_start[j]``)."""
    n = int(group.completion_lens[j])
    counts = group.version_span_counts
    if len(counts) == 0:
        return np.full(n, int(group.version_start[j]), np.int64)
    first = int(np.sum(counts[:j]))
    rows = group.version_spans[first : first + int(counts[j])]
    return np.repeat(rows[:, 0], rows[:, 1]).astype(np.int64)


def _check_spans(group: RolloutGroup) -> None:
    spans, counts, g = group.version_spans, group.version_span_counts, group.group_size
    if len(counts) == 0:
        if len(spans):
            raise WireError("inconsistent", "version_spans without version_span_counts")
        return
    if len(counts) != g or spans.ndim != 2 or spans.shape[1] != 2:
        raise WireError("inconsistent", f"need version_span_counts [{g}] and version_spans [M, 2]")
    if (counts < 0).any() or int(counts.sum()) != len(spans):
        raise WireError("inconsistent", "version_span_counts must be >= 0 and sum to len(version_spans)")
    if len(spans) and ((spans[:, 0] < 0).any() or (spans[:, 1] <= 0).any()):
        raise WireError("inconsistent", "every version span needs version >= 0 and num_tokens > 0")
    owner = np.repeat(np.arange(g), counts)
    covered = np.bincount(owner, weights=spans[:, 1], minlength=g) if len(spans) else np.zeros(g)
    if not np.array_equal(covered.astype(np.int64), group.completion_lens.astype(np.int64)):
        raise WireError("inconsistent", "each sample's version spans must cover exactly its completion tokens")
    has = counts > 0
    if has.any():
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])[has]
        lo, hi = np.minimum.reduceat(spans[:, 0], first), np.maximum.reduceat(spans[:, 0], first)
        if not (np.array_equal(lo, group.version_start[has]) and np.array_equal(hi, group.version_end[has])):
            raise WireError(
                "inconsistent", "version_start / version_end must be the min / max of the sample's span versions"
            )


def check_group(group: RolloutGroup) -> None:
    """Cross-field checks of a :class:`bus.messages.RolloutGroup`; raises ``WireError("inconsistent")``."""
    g = len(group.completion_lens)
    if g == 0:
        raise WireError("inconsistent", "a group needs at least one completion")
    if (group.completion_lens < 0).any() or int(group.completion_lens.sum()) != len(group.completion_ids):
        raise WireError("inconsistent", "completion_lens must be >= 0 and sum to len(completion_ids)")
    if len(group.sampler_logprobs) != len(group.completion_ids):
        raise WireError("inconsistent", "sampler_logprobs and completion_ids differ in length")
    for name in ("version_start", "version_end", "completion_texts", "finish_reasons"):
        if len(getattr(group, name)) != g:
            raise WireError("inconsistent", f"{name} must have one entry per completion ({g})")
    if (group.version_end < group.version_start).any() or (group.version_start < 0).any():
        raise WireError("inconsistent", "need 0 <= version_start <= version_end")
    for name in ("teacher_logprobs", "loss_mask"):
        if len(getattr(group, name)) not in (0, len(group.completion_ids)):
            raise WireError("inconsistent", f"{name} must be empty or have one entry per completion token")
    if len(group.env_rewards) not in (0, g) or not np.isfinite(group.env_rewards).all():
        raise WireError("inconsistent", f"env_rewards must be empty or {g} finite values")
    if not group.temperature > 0:
        raise WireError("inconsistent", "temperature must be > 0")
    _check_spans(group)


def check_micro_batch(mb: MicroBatch) -> None:
    """Cross-field checks of a :class:`bus.messages.MicroBatch`; raises ``WireError("inconsistent")``."""
    t, s = len(mb.input_ids), len(mb.seq_lens)
    if not mb.temperature > 0:
        raise WireError("inconsistent", "temperature must be > 0")
    check_terms(mb.reward_terms, s)
    if not 0 <= mb.micro_index < mb.num_micro_batches or mb.step < 0:
        raise WireError("inconsistent", "need step >= 0 and 0 <= micro_index < num_micro_batches")
    if (mb.seq_lens <= 0).any() or int(mb.seq_lens.sum()) != t:
        raise WireError("inconsistent", "seq_lens must be positive and sum to len(input_ids)")
    for name in ("loss_mask", "sampler_logprobs", "advantages", "token_versions"):
        if len(getattr(mb, name)) != t:
            raise WireError("inconsistent", f"{name} must have one entry per token ({t})")
    if len(mb.teacher_logprobs) not in (0, t):
        raise WireError("inconsistent", f"teacher_logprobs must be empty or have one entry per token ({t})")
    if mb.step_samples < 0 or mb.step_loss_tokens < 0:
        raise WireError("inconsistent", "step_samples and step_loss_tokens must be >= 0")
    for name in ("rewards", "oldest_versions", "sample_ids"):
        if len(getattr(mb, name)) != s:
            raise WireError("inconsistent", f"{name} must have one entry per sample ({s})")
    starts = np.concatenate([[0], np.cumsum(mb.seq_lens)[:-1]]).astype(np.int64)
    lowest = np.minimum.reduceat(mb.token_versions, starts) if s else np.zeros(0, np.int64)
    if (mb.token_versions < 0).any() or not np.array_equal(lowest, mb.oldest_versions):
        raise WireError(
            "inconsistent", "token_versions must be >= 0 with each sample's minimum equal to its oldest_versions"
        )
