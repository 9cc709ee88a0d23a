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
- attention *segments*, in compressed-row order: a prefix (or lone sample) attends causally to
  itself; a tail attends to the whole prefix and causally to itself: its queries are the LAST
  rows of its key sequence prefix + tail, a causal mask aligned bottom-right. The segments'
  queries, concatenated, are the compressed row itself, so one flat layout (`FlatSegments`: the
  key rows of every segment back to back and the int32 offsets `cu_q`, `cu_k`) describes them all;
- `expand` `[T]` maps every original token to its compressed row, so `hidden.index_select(0,
  expand)` is the `[T, H]` hidden states of the unshared forward; its backward sums each shared
  row's gradient over the samples that read it, which is exactly the unshared gradient.

Attention (`segment_attention`), two ways over the same segments:
- CUDA, float16/bfloat16, no dropout (`varlen_kernel_applies`): ONE flash-attention varlen call per
  layer (`trainer.kernels.varlen_attention.varlen_attention`) on the compressed queries and the
  gathered flat keys/values (`flat_segment_attention`); the CPU tests run the same layout through
  a loop of sdpa calls in the kernel's place;
- elsewhere (CPU, float32, dropout): a few padded `scaled_dot_product_attention` calls per
  layer, each over a batch of segments padded to its longest, with a boolean mask built once per
  micro-batch (`padded_segment_attention`; the `PaddedSegments` are built on first use). Prefixes
  (and lone samples) and tails are batched apart, which keeps the short tail queries from being
  padded to the long prefixes (2.6x less attention work on the default job), and long tails of
  varied lengths are cut into batches of similar lengths where padding costs more than another
  call (`BATCH_CALL_COST`; one tail batch on the default job).

Every copy is ONE `index_select` per tensor (backward: `index_add_`, atomics on CUDA), never
advanced indexing `x[idx]`, whose backward is `index_put_(accumulate=True)`: on CUDA that sorts
the indices (pytorch/pytorch#41162) and took 1.10 of 2.33 s GPU time of a 0.5B bf16 GRPO step (H200:
2.74 s per step's forward + backward shared, 1.24 s unshared; 1.15 s shared after); on one CPU
thread `index_select` forward + backward is 2-3x faster too (bench/README.md, shared-prefix speed).

Invariants: every original token maps to a compressed row holding the same token id at the same
position id; a compressed row's keys are exactly the tokens of its sample at positions <= its own;
`plan_shared_prefixes` returns None when no two neighbours share a token (the caller then runs the
unshared path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from trainer.forward.transfer import host_array, to_device
from trainer.kernels.varlen_attention import varlen_attention, varlen_kernel_applies

__all__ = [
    "DEFAULT_MAX_RUN",
    "FlatSegments",
    "PaddedSegments",
    "SharedPrefixPlan",
    "flat_segment_attention",
    "padded_segment_attention",
    "plan_shared_prefixes",
    "segment_attention",
]

DEFAULT_MAX_RUN = 64
"""Most samples in one run: bounds the planner's O(S * max_run) dynamic program (GRPO groups are smaller)."""

BATCH_CALL_COST = 3000
"""The fixed cost of one more padded sdpa call (forward + backward), in attention scores (query-key
pairs) of one batch: ~0.13 ms against ~45 ns per score on one CPU thread (4 heads of 32, the tiny
policy). Splitting the tails by length cut the GRPO-shaped CPU step of bench/shared_prefix_speed.py
by 13% (1.14 -> 1.00 s, two batches against 7-8; 10000: 1.01 s) and left the default job's alone
(0.15 s); a larger value pads more, a smaller one calls more."""

Attend = Callable[..., torch.Tensor]
"""`varlen_attention`'s signature: (query [Tq,H,D], key [Tk,Hkv,D], value, cu_q, cu_k, max_q, max_k, scaling) -> [Tq,H,D]."""


@dataclass(frozen=True)
class FlatSegments:
    """Every attention segment of a compressed row, back to back (flash-attention varlen layout).

    Segment i's queries are compressed rows `cu_q[i]:cu_q[i+1]` (the segments in row order, so the
    queries are the row itself); its keys are rows `key_rows[cu_k[i]:cu_k[i+1]]`: the prefix
    rows, then its own rows, its queries the last of them (bottom-right causal alignment).

    Fields (N = segments, T_c = compressed tokens, T_k = sum of key lengths):
        key_rows: `[T_k]` int64 compressed row of each flat key.
        cu_q: `[N + 1]` int32 query offsets, `cu_q[-1] == T_c`.
        cu_k: `[N + 1]` int32 key offsets, `cu_k[-1] == T_k`.
        max_q, max_k: the longest segment's queries / keys (host ints).
    """

    key_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    def to(self, device: torch.device | str) -> FlatSegments:
        """The same layout with every tensor on ``device``."""
        device = torch.device(device)
        return FlatSegments(
            *(to_device(t, device) for t in (self.key_rows, self.cu_q, self.cu_k)), self.max_q, self.max_k
        )


@dataclass(frozen=True)
class PaddedSegments:
    """The segments as padded sdpa batches, each padded to its longest segment (see the module docstring).

    Fields (batch b: n_b segments, Lq_b / Lk_b = its longest segment's queries / keys):
        q_rows: `[sum_b n_b * Lq_b]` int64 compressed rows of each batch's queries, batch after
            batch, row-major (padding: the segment's first query row).
        k_rows: `[sum_b n_b * Lk_b]` int64 compressed rows of each batch's keys: prefix rows, then
            own rows (padding: row 0, masked out).
        masks: per batch `[n_b, 1, Lq_b, Lk_b]` bool, True where a query may attend a key (padded
            queries attend key 0 so that their softmax stays finite; their outputs are never read).
        out_rows: `[T_c]` int64: compressed row r's output is row `out_rows[r]` of the batches'
            `[n_b * Lq_b]` query outputs concatenated. Each compressed row is a real query of
            exactly one batch.
    """

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    masks: tuple[torch.Tensor, ...]
    out_rows: torch.Tensor


@dataclass(frozen=True)
class SharedPrefixPlan:
    """How one packed row is compressed for a shared-prefix forward (see the module docstring).

    Fields (T = original tokens, T_c = compressed tokens, all tensors on one device):
        row_ids: `[T_c]` int64 token ids of the compressed row.
        position_ids: `[T_c]` int64 position of each compressed token within its sample(s).
        expand: `[T]` int64 compressed row index of each original token.
        segments: the attention segments (`FlatSegments`).
        saved_tokens: T - T_c, tokens the decoder no longer runs.
        table: `[N, 4]` int64 host array (q_start, q_len, prefix_start, prefix_len) per segment.

    `padded` (the `PaddedSegments`, on the plan's device) is built on first use and kept: the
    varlen path never needs its masks.
    """

    row_ids: torch.Tensor
    position_ids: torch.Tensor
    expand: torch.Tensor
    segments: FlatSegments
    saved_tokens: int
    table: np.ndarray = field(repr=False)

    def to(self, device: torch.device | str) -> SharedPrefixPlan:
        """The same plan with every tensor on ``device``."""
        return SharedPrefixPlan(
            row_ids=to_device(self.row_ids, torch.device(device)),
            position_ids=to_device(self.position_ids, torch.device(device)),
            expand=to_device(self.expand, torch.device(device)),
            segments=self.segments.to(device),
            saved_tokens=self.saved_tokens,
            table=self.table,
        )

    @functools.cached_property
    def padded(self) -> PaddedSegments:
        """The padded sdpa batches of `table`, on `row_ids`' device (built once per plan)."""
        return _padded_segments(self.table, self.row_ids.device)


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
    ids = host_array(input_ids, "input_ids").astype(np.int64, copy=False)
    lens = host_array(seq_lens, "seq_lens").astype(np.int64, copy=False)
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
    """Attention of a compressed row: every segment attends to its own keys.

    One flash-attention varlen call where `varlen_kernel_applies` (CUDA, float16/bfloat16, no
    dropout): `flat_segment_attention`; else a few padded sdpa calls: `padded_segment_attention`.

    Args:
        query: `[1, heads, T_c, head_dim]`; key, value: `[1, kv_heads, T_c, head_dim]` (kv_heads
            divides heads: grouped-query attention, NOT repeated).
        plan: the row's `SharedPrefixPlan`, on the query's device.
        scaling: softmax scale (None: 1/sqrt(head_dim)). dropout_p: attention dropout probability.

    Returns:
        `[1, T_c, heads, head_dim]` in the query's dtype: softmax(q k^T * scale + mask) v
        (Vaswani et al. 2017, eq. 1) for each compressed token over the keys of its segment.
    """
    if varlen_kernel_applies(query, dropout_p):
        return flat_segment_attention(query, key, value, plan.segments, scaling, varlen_attention)
    return padded_segment_attention(query, key, value, plan.padded, scaling, dropout_p)


def flat_segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: FlatSegments,
    scaling: float | None,
    attend: Attend,
) -> torch.Tensor:
    """`segment_attention` (same query/key/value/scaling and result) in ONE `attend` call over
    `segments` (the plan's `FlatSegments`, on the query's device). `attend`: `varlen_attention`
    (the CUDA flash kernel), or a reference with its signature (the CPU tests' loop of sdpa calls,
    tests/trainer/test_shared_prefix.py)."""
    q = query[0].transpose(0, 1).contiguous()  # [T_c, H, D]; no copy when q is a transposed projection
    k = key[0].transpose(0, 1).index_select(0, segments.key_rows)  # [T_k, Hkv, D]
    v = value[0].transpose(0, 1).index_select(0, segments.key_rows)
    return attend(q, k, v, segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, scaling)[None]


def padded_segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded: PaddedSegments,
    scaling: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """`segment_attention` (same arguments but `padded`, the plan's `PaddedSegments` on the
    query's device; same result) as one padded sdpa call per batch (CPU, float32, dropout)."""
    # one gather per tensor for all batches, then views: each index_select's backward allocates a
    # [T_c, heads, d] gradient, so one per batch would cost O(batches * T_c)
    q_all, k_all, v_all = (
        t[0].transpose(0, 1).index_select(0, rows)  # [rows, heads, d]
        for t, rows in ((query, padded.q_rows), (key, padded.k_rows), (value, padded.k_rows))
    )
    q_sizes = [m.shape[0] * m.shape[2] for m in padded.masks]
    k_sizes = [m.shape[0] * m.shape[3] for m in padded.masks]
    outs = []
    for mask, q, k, v in zip(padded.masks, q_all.split(q_sizes), k_all.split(k_sizes), v_all.split(k_sizes)):
        n, _, lq, lk = mask.shape
        q, k, v = (t.view(n, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [n, heads, L, d]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1]
        )
        outs.append(out.transpose(1, 2).reshape(n * lq, out.shape[1], out.shape[3]))  # [n * Lq, heads, d]
    return torch.cat(outs).index_select(0, padded.out_rows)[None]  # [1, T_c, heads, d]


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
    segments: list[tuple[int, int, int, int]] = []  # (q_start, q_len, prefix_start, prefix_len), row order
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
    table = np.array(segments, dtype=np.int64)
    original = np.concatenate(rows)
    return SharedPrefixPlan(
        row_ids=torch.from_numpy(ids[original]),
        position_ids=torch.from_numpy(np.concatenate(positions)),
        expand=torch.from_numpy(np.concatenate(expand)),
        segments=_flat_segments(table),
        saved_tokens=len(ids) - len(original),
        table=table,
    )


def _flat_segments(table: np.ndarray) -> FlatSegments:
    """The `FlatSegments` of segments `[N, 4]` (q_start, q_len, prefix_start, prefix_len) in row order."""
    q_start, q_len, p_start, p_len = table.T
    assert (q_start == np.concatenate([[0], np.cumsum(q_len)[:-1]])).all(), "segments must tile the row in order"
    key_rows = np.concatenate([np.r_[p0 : p0 + p, q0 : q0 + n] for q0, n, p0, p in table])
    k_len = p_len + q_len
    cu = np.zeros((2, len(table) + 1), np.int32)
    cu[0, 1:], cu[1, 1:] = np.cumsum(q_len), np.cumsum(k_len)
    return FlatSegments(
        key_rows=torch.from_numpy(key_rows.astype(np.int64)),
        cu_q=torch.from_numpy(cu[0]),
        cu_k=torch.from_numpy(cu[1]),
        max_q=int(q_len.max()),
        max_k=int(k_len.max()),
    )


def _padded_segments(table: np.ndarray, device: torch.device) -> PaddedSegments:
    """The `PaddedSegments` of segments `[N, 4]` (q_start, q_len, prefix_start, prefix_len), batched by `_batches`."""
    q_rows, k_rows, masks = [], [], []
    out_rows, offset = np.empty(int(table[:, 1].sum()), np.int64), 0
    for part in _batches(table):
        rows_q, rows_k, mask = _segment_batch(part)
        lq = mask.shape[2]
        for i, (q0, n) in enumerate(part[:, :2]):
            out_rows[q0 : q0 + n] = offset + i * lq + np.arange(n)
        offset += len(part) * lq
        q_rows.append(rows_q)
        k_rows.append(rows_k)
        masks.append(to_device(mask, device))
    return PaddedSegments(
        q_rows=to_device(np.concatenate(q_rows), device),
        k_rows=to_device(np.concatenate(k_rows), device),
        masks=tuple(masks),
        out_rows=to_device(out_rows, device),
    )


def _batches(table: np.ndarray) -> list[np.ndarray]:
    """Segments `[N, 4]` split into padded batches: the prefixes (and lone samples) apart from the
    tails, each kind sorted by key length and cut greedily where padding the next segment into the
    batch would cost more attention scores than `BATCH_CALL_COST` plus its own."""
    out = []
    for part in (table[table[:, 3] == 0], table[table[:, 3] > 0]):
        current: list[int] = []
        n = max_q = max_k = 0
        for i in np.lexsort((part[:, 1], part[:, 1] + part[:, 3])):
            q, k = int(part[i, 1]), int(part[i, 1] + part[i, 3])
            joined = (n + 1) * max(max_q, q) * max(max_k, k)
            if current and joined > n * max_q * max_k + BATCH_CALL_COST + q * k:
                out.append(part[current])
                current, n, max_q, max_k = [], 0, 0, 0
            current.append(int(i))
            n, max_q, max_k = n + 1, max(max_q, q), max(max_k, k)
        if current:
            out.append(part[current])
    return out


def _segment_batch(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[n * Lq]` query rows, `[n * Lk]` key rows and the `[n, 1, Lq, Lk]` mask of segments `[n, 4]`
    (q_start, q_len, prefix_start, prefix_len), padded to the longest."""
    q_start, q_len, p_start, p_len = seg.T
    lq, lk = int(q_len.max()), int((p_len + q_len).max())
    i = np.arange(lq)[None, :]
    j = np.arange(lk)[None, :]
    valid = i < q_len[:, None]
    q_rows = q_start[:, None] + np.where(valid, i, 0)
    in_prefix = j < p_len[:, None]
    k_rows = np.where(in_prefix, p_start[:, None] + j, q_start[:, None] + np.clip(j - p_len[:, None], 0, None))
    k_rows = np.where(j < (p_len + q_len)[:, None], k_rows, 0)
    mask = (j[:, None, :] < (p_len + q_len)[:, None, None]) & (j[:, None, :] <= i[:, :, None] + p_len[:, None, None])
    mask = np.where(valid[:, :, None], mask, j[:, None, :] == 0)
    return q_rows.reshape(-1), k_rows.reshape(-1), mask[:, None]
