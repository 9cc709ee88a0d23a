"""One sampled completion as the rollout engine returns it, and its per-token policy versions.

`producers.engine.RolloutEngine.generate_group` returns `Sample`s; the episode runners
(`producers.episodes`, `producers.agents`, `producers.endpoint_episodes`) build them too.
Invariant: `token_ids`, `logprobs` and (when known) `token_versions` have one entry per generated
token, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sample", "token_versions"]


@dataclass(frozen=True)
class Sample:
    """One completion of a group.

    token_ids: [num_tokens] generated token ids (prompt excluded).
    logprobs: [num_tokens] logprob of each sampled token under the policy that sampled it
        (per the engine's logprobs_mode; raw = before temperature / top-p by default).
    text: detokenized completion ("" when generated with `detokenize=False`).
    finish_reason: "stop" (EOS / stop token) or "length" (max_tokens reached) or "abort".
    version_start / version_end: oldest / newest policy version that produced a token (the first /
        last token's, unless a rollback made later tokens older).
    version_spans: [(version, start, end), ...] tokens `[start, end)` came from `version`, in
        order (one span unless weights changed mid-sample); empty when vLLM reported none.
    token_versions: [num_tokens] policy version of each token (:func:`token_versions` of the
        spans); empty from callers that know none (every token then counts as `version_start`).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    version_start: int
    version_end: int
    version_spans: tuple[tuple[int, int, int], ...] = ()
    token_versions: tuple[int, ...] = ()


def token_versions(spans: tuple[tuple[int, int, int], ...], num_tokens: int, default: int) -> np.ndarray:
    """Policy version of each of `num_tokens` output tokens, `[num_tokens] int64`, from vLLM's
    `(version, start, end)` spans (clipped to the output; a token no span covers, e.g. when vLLM
    reported none, gets `default`: the version when the request was issued, its oldest possible)."""
    out = np.full(num_tokens, default, np.int64)
    for version, start, end in spans:
        out[max(start, 0) : max(min(end, num_tokens), 0)] = version
    return out
