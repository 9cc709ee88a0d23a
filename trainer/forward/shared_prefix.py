"""Shared-prefix packing: a group's prompt runs through the decoder once, not once per completion.

A GRPO group is G completions of ONE prompt, so a packed micro-batch holds the same prompt tokens G
times over. The decoder's hidden state at position t depends only on the tokens at positions <= t
of its own sample (causal attention, positions restarting at 0 per sample: `trainer.forward.packed`), so
samples whose first p tokens are identical have identical hidden states at positions < p. Running
those positions once and copying their hidden states to every sample changes no number the loss
sees (up to float rounding of a different matmul shape) and, on the default reverse-text job
(prompts ~42 tokens, completions <= 16), cuts the decoder's tokens per step by ~60% and the
trainer's step time by ~half (bench/README.md). This is the shared-prefix forward of Prefix Grouper
(Liu et al. 2025, arXiv:2506.05433), applied to consecutive packed samples of any origin.

The plan (`plan_shared_prefixes`, pure, from token ids and sample lengths):
- a *run* is a maximal stretch of consecutive samples i..j-1 whose first p tokens are identical;
  p is the longest common prefix of the run (the minimum of its neighbours' common prefixes). The
  runs maximise the tokens saved, sum over runs of (size - 1) * p, by dynamic programming over at
  most `max_run` samples per run (a run across two groups only shares the chat template's first
  tokens, so the optimum keeps whole groups together even when the micro-batch starts mid-group);
- the compressed row holds, per run, the prefix once and then each sample's tail (its tokens after
  p); a run of one sample is the sample itself;
- attention segments: the prefix attends causally to itself; a tail attends to the whole prefix
  and causally to itself (queries at positions p.., keys prefix + tail). Prefixes (and lone
  samples) form one `SegmentBatch`, tails another: each is ONE `scaled_dot_product_attention` call
  per layer, padded to its longest segment, with a boolean mask built once per micro-batch
  (`segment_attention`); two batches instead of one keep the short tail queries from being padded
  to the long prefixes (2.6x less attention work on the default job);
- `expand` `[T]` maps every original token to its compressed row, so `hidden[expand]` is the
  `[T, H]` hidden states of the unshared forward; its backward sums each shared row's gradient over
  the samples that read it, which is exactly the unshared gradient.

Invariants: every original token maps to a compressed row holding the same token id at the same
position id; a compressed row's keys are exactly the tokens of its sample at positions <= its own;
`plan_shared_prefixes` returns None when no two neighbours share a token (the caller then runs the
unshared path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_MAX_RUN", "SegmentBatch", "SharedPrefixPlan", "plan_shared_prefixes", "segment_attention"]

DEFAULT_MAX_RUN = 64
"""Most samples in one run: bounds the planner's O(S * max_run) dynamic program (GRPO groups are smaller)."""


@dataclass(frozen=True)
class SegmentBatch:
    """Attention segments of one kind, padded to a common shape (see the module docstring).

    Fields (n = segments, Lq / Lk = the longest segment's queries / keys):
        q_idx: `[n, Lq]` int64 compressed rows of each segment's queries (padding: a valid row).
        k_idx: `[n, Lk]` int64 compressed rows of each segment's keys: prefix rows, then own rows.
        mask: `[n, 1, Lq, Lk]` bool, True where a query may attend a key (padded queries attend
            key 0 so that their softmax stays finite; their outputs are dropped).
        valid: `[n, Lq]` bool, True on real queries.
    """

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor

    def to(self, device: torch.device | str) -> SegmentBatch:
        """The same batch with every tensor on ``device``."""
        return SegmentBatch(*(t.to(device) for t in (self.q_idx, self.k_idx, self.mask, self.valid)))


@dataclass(frozen=True)
class SharedPrefixPlan:
    """How one packed row is compressed for a shared-prefix forward (see the module docstring).

    Fields (T = original tokens, T_c = compressed tokens, all on one device):
        row_ids: `[T_c]` int64 token ids of the compressed row.
        position_ids: `[T_c]` int64 position of each compressed token within its sample(s).
        expand: `[T]` int64 compressed row index of each original token.
        batches: the `SegmentBatch`es (prefixes and lone samples; tails), each compressed row a
            valid query of exactly one.
        order: `[T_c]` int64: compressed row r's output is entry `order[r]` of the batches' valid
            queries concatenated (each batch's in row-major order).
        saved_tokens: T - T_c, tokens the decoder no longer runs.
    """

    row_ids: torch.Tensor
    position_ids: torch.Tensor
    expand: torch.Tensor
    batches: tuple[SegmentBatch, ...]
    order: torch.Tensor
    saved_tokens: int

    def to(self, device: torch.device | str) -> SharedPrefixPlan:
        """The same plan with every tensor on ``device``."""
        return SharedPrefixPlan(
            row_ids=self.row_ids.to(device),
            position_ids=self.position_ids.to(device),
            expand=self.expand.to(device),
            batches=tuple(b.to(device) for b in self.batches),
            order=self.order.to(device),
            saved_tokens=self.saved_tokens,
        )


def plan_shared_prefixes(
    input_ids: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray, *, max_run: int = DEFAULT_MAX_RUN
) -> SharedPrefixPlan | None:
    """Plan the shared-prefix forward of one packed row; None when no neighbours share a prefix.

    Args:
        input_ids: `[T]` integer token ids of the packed samples (any device; read on the host).
        seq_lens: `[S]` integer sample lengths >= 1 summing to T.
        max_run: most samples in one run, >= 1.

    Returns:
        A CPU `SharedPrefixPlan`, or None when every run would be a single sample.

    Raises:
        ValueError: lengths not >= 1, not summing to T, or max_run < 1.
    """
    ids = _host_array(input_ids).astype(np.int64, copy=False)
    lens = _host_array(seq_lens).astype(np.int64, copy=False)
    if max_run < 1:
        raise ValueError(f"max_run must be >= 1, got {max_run}")
    if lens.ndim != 1 or len(lens) == 0 or (lens < 1).any() or int(lens.sum()) != len(ids):
        raise ValueError(f"seq_lens must be >= 1 and sum to len(input_ids)={len(ids)}, got {lens.tolist()}")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    samples = [ids[s : s + n] for s, n in zip(starts, lens)]
    runs = _best_runs(_neighbour_prefixes(samples), max_run)
    if all(j - i == 1 for i, j, _p in runs):
        return None
    return _build_plan(ids, starts, lens, runs)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: SharedPrefixPlan,
    scaling: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Attention of a compressed row: every segment attends to its own keys, one sdpa call per
    `SegmentBatch` (prefixes and lone samples; tails).

    Args:
        query: `[1, heads, T_c, head_dim]`; key, value: `[1, heads, T_c, head_dim]` (key/value
            heads already repeated to `heads` for grouped-query attention).
        plan: the row's `SharedPrefixPlan`, on the query's device.
        scaling: softmax scale (None: 1/sqrt(head_dim)). dropout_p: attention dropout probability.

    Returns:
        `[1, T_c, heads, head_dim]`: softmax(q k^T * scale + mask) v (Vaswani et al. 2017, eq. 1)
        for each compressed token over the keys of its segment.
    """
    outs = []
    for batch in plan.batches:
        q = query[0][:, batch.q_idx].transpose(0, 1)  # [n, heads, Lq, d]
        k = key[0][:, batch.k_idx].transpose(0, 1)  # [n, heads, Lk, d]
        v = value[0][:, batch.k_idx].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scaling, dropout_p=dropout_p)
        outs.append(out.transpose(1, 2)[batch.valid])  # [valid queries, heads, d]
    return torch.cat(outs)[plan.order][None]  # [1, T_c, heads, d]


def _host_array(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 1-D host numpy view of a tensor or array."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def _neighbour_prefixes(samples: list[np.ndarray]) -> list[int]:
    """`[S - 1]` longest common prefix (tokens) of each sample with the next one."""
    out = []
    for a, b in zip(samples, samples[1:]):
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        out.append(int(differ[0]) if len(differ) else n)
    return out


def _best_runs(neighbours: list[int], max_run: int) -> list[tuple[int, int, int]]:
    """(first, end, prefix) of the runs maximising sum (size - 1) * prefix (dynamic programming).

    best[j] is the most tokens saved over samples 0..j-1; the last run i..j-1 shares
    min(neighbours[i..j-2]) tokens. A pair sharing nothing ends every run through it.
    """
    num = len(neighbours) + 1
    best = [0] * (num + 1)
    choice = [(0, 0)] * (num + 1)  # (start of the last run, its prefix)
    for end in range(1, num + 1):
        best[end], choice[end] = best[end - 1], (end - 1, 0)
        common = None
        for first in range(end - 2, max(-1, end - 1 - max_run), -1):
            common = neighbours[first] if common is None else min(common, neighbours[first])
            if common == 0:
                break
            saved = best[first] + (end - 1 - first) * common
            if saved > best[end]:
                best[end], choice[end] = saved, (first, common)
    runs = []
    end = num
    while end > 0:
        first, common = choice[end]
        runs.append((first, end, common))
        end = first
    return runs[::-1]


def _build_plan(
    ids: np.ndarray, starts: np.ndarray, lens: np.ndarray, runs: list[tuple[int, int, int]]
) -> SharedPrefixPlan:
    """The compressed row, its expansion and its attention segments for the given runs."""
    rows: list[np.ndarray] = []  # original token indices of the compressed row, in order
    positions: list[np.ndarray] = []
    expand: list[np.ndarray] = []
    segments: list[tuple[int, int, int, int]] = []  # (q_start, q_len, prefix_start, prefix_len)
    filled = 0
    for first, end, common in runs:
        prefix = common if end - first > 1 else int(lens[first])
        prefix_start = filled
        rows.append(starts[first] + np.arange(prefix))
        positions.append(np.arange(prefix))
        segments.append((prefix_start, prefix, 0, 0))
        filled += prefix
        for s in range(first, end):
            tail = int(lens[s]) - prefix
            expand.append(prefix_start + np.arange(prefix))
            expand.append(filled + np.arange(tail))
            if tail:
                rows.append(starts[s] + prefix + np.arange(tail))
                positions.append(prefix + np.arange(tail))
                segments.append((filled, tail, prefix_start, prefix))
                filled += tail
    seg = np.array(segments, dtype=np.int64)
    kinds = [seg[seg[:, 3] == 0], seg[seg[:, 3] > 0]]  # prefixes and lone samples; tails
    batches = tuple(_segment_batch(part) for part in kinds if len(part))
    queries = np.concatenate([start + np.arange(n) for part in kinds for start, n in part[:, :2]])
    order = np.empty(len(queries), np.int64)
    order[queries] = np.arange(len(queries))
    original = np.concatenate(rows)
    return SharedPrefixPlan(
        row_ids=torch.from_numpy(ids[original]),
        position_ids=torch.from_numpy(np.concatenate(positions)),
        expand=torch.from_numpy(np.concatenate(expand)),
        batches=batches,
        order=torch.from_numpy(order),
        saved_tokens=len(ids) - len(original),
    )


def _segment_batch(seg: np.ndarray) -> SegmentBatch:
    """The padded index and mask tensors of segments `[n, 4]` (q_start, q_len, prefix_start, prefix_len)."""
    q_start, q_len, p_start, p_len = seg.T
    lq, lk = int(q_len.max()), int((p_len + q_len).max())
    i = np.arange(lq)[None, :]
    j = np.arange(lk)[None, :]
    valid = i < q_len[:, None]
    q_idx = q_start[:, None] + np.where(valid, i, 0)
    in_prefix = j < p_len[:, None]
    k_idx = np.where(in_prefix, p_start[:, None] + j, q_start[:, None] + np.clip(j - p_len[:, None], 0, None))
    k_idx = np.where(j < (p_len + q_len)[:, None], k_idx, 0)
    mask = (j[:, None, :] < (p_len + q_len)[:, None, None]) & (j[:, None, :] <= i[:, :, None] + p_len[:, None, None])
    mask = np.where(valid[:, :, None], mask, j[:, None, :] == 0)
    return SegmentBatch(
        q_idx=torch.from_numpy(q_idx),
        k_idx=torch.from_numpy(k_idx),
        mask=torch.from_numpy(mask[:, None]),
        valid=torch.from_numpy(valid),
    )
