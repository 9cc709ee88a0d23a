"""Shared-prefix packing: a group's prompt runs through the decoder once, not once per completion.

Samples whose first p tokens are equal have equal hidden states there (causal attention, positions
per sample), so those positions run once: Prefix Grouper's shared-prefix forward (Liu et al. 2025,
arXiv:2506.05433). `plan_shared_prefixes` picks runs of neighbours saving the most tokens (dynamic
programming) and builds the compressed row, the `expand` index back to `[T]` and the attention
segments (a prefix causal on itself; a tail on its prefix and causal on itself, bottom-right). They
run as one flash varlen call on CUDA (fp16/bf16), else as padded sdpa calls. Gathers are
`index_select`s, whose backward avoids `index_put_`'s sort (pytorch/pytorch#41162).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from trainer.kernels.transfer import host_array, to_device
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
"""The cost of one more padded sdpa call, in attention scores (query-key pairs); measured in
bench/README.md ("Shared-prefix speed")."""

Attend = Callable[..., torch.Tensor]
"""`varlen_attention`'s signature: (q [Tq,H,D], k [Tk,Hkv,D], v, cu_q, cu_k, max_q, max_k, scaling) -> [Tq,H,D]."""


@dataclass(frozen=True)
class FlatSegments:
    """Segment i: queries `cu_q[i]:cu_q[i+1]` (int32), keys `key_rows[cu_k[i]:cu_k[i+1]]` (int64 rows, prefix
    then own), the flash-attention varlen layout.
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
    """Padded sdpa batches: `q_rows`, `k_rows` int64 compressed rows, per batch a `[n, 1, Lq, Lk]` bool mask,
    and `out_rows` `[T_c]`, each compressed row's place in the batches' concatenated outputs.
    """

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    masks: tuple[torch.Tensor, ...]
    out_rows: torch.Tensor


@dataclass(frozen=True)
class SharedPrefixPlan:
    """One packed row of T tokens compressed to T_c: `row_ids`, `position_ids` `[T_c]` int64, `expand` `[T]`
    int64, `table` `[N, 4]` host (q_start, q_len, prefix_start, prefix_len); `padded` built on first use.
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
        """The padded sdpa batches of `table` on `row_ids`' device (built once)."""
        return _padded_segments(self.table, self.row_ids.device)


def plan_shared_prefixes(
    input_ids: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray, *, max_run: int = DEFAULT_MAX_RUN
) -> SharedPrefixPlan | None:
    """A CPU `SharedPrefixPlan` of `input_ids` `[T]` split by `seq_lens` `[S]`, or None when no neighbours
    share a prefix; ValueError for lengths < 1 or not summing to T, or a max_run < 1.
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
    """`[1, T_c, heads, head_dim]`: each token of query `[1, heads, T_c, head_dim]` over its segment's keys
    (key/value `[1, kv_heads, T_c, head_dim]`); one flash varlen call where `varlen_kernel_applies`.
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
    """`segment_attention` in one `attend` call (`varlen_attention`, or a reference with its signature)."""
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
    """`segment_attention` as one padded sdpa call per batch of `padded`."""
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
    """(first, end, prefix) of the runs maximising sum (size - 1) * prefix, by dynamic programming."""
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
    """The `FlatSegments` of segments `[N, 4]` (q_start, q_len, prefix_start, prefix_len)."""
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
    """The `PaddedSegments` of segments `[N, 4]`, batched by `_batches`."""
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
    """Segments in padded batches: prefixes apart from tails, cut where padding costs over `BATCH_CALL_COST`."""
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
    """Query rows, key rows and the `[n, 1, Lq, Lk]` mask of segments `[n, 4]`, padded to the longest."""
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
