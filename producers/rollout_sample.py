"""One sampled completion as the rollout engine (and the episode runners) return it, with per-token versions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sample", "token_versions"]


@dataclass(frozen=True)
class Sample:
    """One completion: `token_ids`, `logprobs` (engine's logprobs_mode) and `token_versions` (empty: all
    `version_start`), each `[num_tokens]`; `text` ("" without detokenizing); `finish_reason` "stop" | "length" |
    "abort"; `version_start`/`version_end` the oldest/newest version of a token; `version_spans` vLLM's
    `(version, start, end)` runs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    version_start: int
    version_end: int
    version_spans: tuple[tuple[int, int, int], ...] = ()
    token_versions: tuple[int, ...] = ()


def token_versions(spans: tuple[tuple[int, int, int], ...], num_tokens: int, default: int) -> np.ndarray:
    """`[num_tokens] int64` versions from vLLM's `(version, start, end)` spans, clipped; uncovered: `default`."""
    out = np.full(num_tokens, default, np.int64)
    for version, start, end in spans:
        out[max(start, 0) : max(min(end, num_tokens), 0)] = version
    return out
