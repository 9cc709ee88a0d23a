"""The packer's step path (packer.assemble: plan from lengths, fill micro-batch arrays straight from
the scored groups) against the per-sample construction it replaced (group_samples copies, then
build_micro_batch), kept here as the reference: every field of every micro-batch must be
byte-identical.

The groups are random but realistic and pass the wire's checks (they go through the real codec):
mixed prompt and completion lengths (empty completions included), two temperatures, multi-turn
environment tokens, samples masked by an enforced filter, partial rollouts whose tokens span several
policy versions (and groups whose sender knew no spans), teacher logprobs or not, and reward terms
whose names differ between groups.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bus.codec import decode, encode
from bus.messages import MicroBatch, ScoredGroup
from packer.assemble import pack_groups, plan_step
from packer.packer import PackedSample, Packer, build_micro_batch, group_samples, pack_step
from packer.packing import pack_micro_batches


def reference_pack_step(groups: list[list[PackedSample]], step: int, budget: int) -> list[MicroBatch]:
    """``packer.packer.pack_step`` as it was before packer.assemble (commit 9b5c977), verbatim in
    substance: the reference construction."""
    samples = [s for g in groups for s in g]
    loss_tokens = int(sum(s.loss_mask.sum() for s in samples))
    loss_samples = sum(1 for s in samples if s.loss_mask.any())
    bins: list[list[PackedSample]] = []
    for temperature in sorted({s.temperature for s in samples}):
        same = [[s for s in g if s.temperature == temperature] for g in groups]
        units: list[list[PackedSample]] = []
        for g in same:
            if not g:
                continue
            if sum(len(s.input_ids) for s in g) <= budget:
                units.append(g)
            else:
                units += [[s] for s in g]
        packed = pack_micro_batches([sum(len(s.input_ids) for s in unit) for unit in units], budget)
        bins += [[s for i in idx for s in units[i]] for idx in packed]
    return [
        build_micro_batch(
            b,
            step=step,
            micro_index=k,
            num_micro_batches=len(bins),
            step_loss_tokens=loss_tokens,
            step_samples=loss_samples,
        )
        for k, b in enumerate(bins)
    ]


def random_group(rng: np.random.Generator, index: int, *, teacher: bool, spans: bool) -> ScoredGroup:
    """A scored group as the reward worker sends it (decoded from the real codec)."""
    g = int(rng.integers(1, 7))
    prompt = rng.integers(0, 50_000, int(rng.integers(1, 40)), dtype=np.int32)  # samples <= 98 tokens
    lens = rng.integers(0, 60, g).astype(np.int32)
    lens[rng.random(g) < 0.15] = 0  # a completion with no token (stopped at once)
    n = int(lens.sum())
    fields: dict = {}
    starts, ends = rng.integers(0, 5, g), None
    if spans:  # partial rollouts: each sample's tokens in 1-3 runs of versions (not always increasing)
        per_sample = []
        for j in range(g):
            cut_count = min(int(rng.integers(0, 3)), max(int(lens[j]) - 1, 0))
            cuts = (
                np.sort(rng.choice(np.arange(1, int(lens[j])), cut_count, replace=False))
                if cut_count
                else np.zeros(0, np.int64)
            )
            runs = np.diff(np.concatenate([[0], cuts, [lens[j]]])).astype(np.int64)
            runs = runs[runs > 0]
            per_sample.append(
                np.stack([rng.integers(0, 6, len(runs)), runs], axis=1) if len(runs) else np.zeros((0, 2), np.int64)
            )
        fields["version_spans"] = np.concatenate(per_sample).astype(np.int64)
        fields["version_span_counts"] = np.array([len(s) for s in per_sample], np.int32)
        starts = np.array([s[:, 0].min() if len(s) else int(rng.integers(0, 5)) for s in per_sample], np.int64)
        ends = np.array([s[:, 0].max() if len(s) else starts[j] for j, s in enumerate(per_sample)], np.int64)
    if teacher:
        fields["teacher_logprobs"] = -rng.random(n).astype(np.float32)
    if rng.random() < 0.4:  # multi-turn: environment tokens are context
        fields["loss_mask"] = rng.random(n) < 0.7
    if rng.random() < 0.5:
        fields["masked"] = rng.random(g) < 0.3
    names = ["lcs", "format"] if index % 3 else ["lcs"]
    return decode(
        encode(
            ScoredGroup(
                id=f"p{index:03d}",
                prompt_index=index,
                step=0,
                task="t",
                info={},
                producer="p0",
                completion_texts=[""] * g,
                finish_reasons=["stop"] * g,
                gen_time_s=0.0,
                prompt_ids=prompt,
                completion_ids=rng.integers(0, 50_000, n, dtype=np.int32),
                completion_lens=lens,
                sampler_logprobs=-rng.random(n).astype(np.float32),
                version_start=np.asarray(starts, np.int64),
                version_end=np.asarray(starts if ends is None else ends, np.int64),
                temperature=float(rng.choice([0.7, 1.0])),
                reward_worker="r0",
                rewards=rng.random(g).astype(np.float32),
                advantages=rng.normal(size=g).astype(np.float32),
                reward_terms={name: rng.random(g).tolist() for name in names},
                **fields,
            )
        )
    )


def assert_identical(new: list[MicroBatch], ref: list[MicroBatch]) -> None:
    """Every field of every micro-batch equal; arrays equal in dtype, shape and bytes; same frames."""
    assert len(new) == len(ref)
    for a, b in zip(new, ref):
        for f in dataclasses.fields(MicroBatch):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert isinstance(x, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f.name
                assert x.tobytes() == y.tobytes(), f"{a.id}: {f.name} differs"
            else:
                assert type(x) is type(y) and x == y, f"{a.id}: {f.name}: {x!r} != {y!r}"
        assert [bytes(frame) for frame in encode(a)] == [bytes(frame) for frame in encode(b)]


@pytest.mark.parametrize("teacher", [False, True])
@pytest.mark.parametrize("budget", [100, 400, 4096])  # groups split per sample / some whole / all whole
def test_filled_micro_batches_equal_the_per_sample_construction(teacher: bool, budget: int):
    for seed in range(4):
        rng = np.random.default_rng([seed, budget, int(teacher)])
        groups = [random_group(rng, i, teacher=teacher, spans=i % 4 != 3) for i in range(12)]
        ref = reference_pack_step([group_samples(g, teacher=teacher) for g in groups], 7, budget)
        assert any(len(mb.sample_ids) > 1 for mb in ref)
        packer = Packer(len(groups), 8, budget, teacher=teacher)
        assert_identical(packer.pack(groups, 7), ref)
        # pack_step (PackedSample callers) now plans with plan_step: still the same micro-batches
        assert_identical(pack_step([group_samples(g, teacher=teacher) for g in groups], 7, budget), ref)


def test_the_random_groups_cover_every_case():
    rng = np.random.default_rng(0)
    groups = [random_group(rng, i, teacher=True, spans=i % 4 != 3) for i in range(48)]
    assert any(len(g.version_span_counts) == 0 for g in groups)
    assert any((g.version_span_counts > 1).any() for g in groups if len(g.version_span_counts))
    assert any((g.completion_lens == 0).any() for g in groups)
    assert any(len(g.loss_mask) and not g.loss_mask.all() for g in groups)
    assert any(len(g.masked) and g.masked.any() for g in groups)
    assert len({g.temperature for g in groups}) == 2 and len({tuple(g.reward_terms) for g in groups}) == 2


def test_teacher_packing_refuses_a_group_without_teacher_logprobs():
    rng = np.random.default_rng(1)
    groups = [random_group(rng, 0, teacher=True, spans=True), random_group(rng, 1, teacher=False, spans=True)]
    groups[1] = dataclasses.replace(
        groups[1],
        completion_lens=np.array([3], np.int32),
        completion_ids=np.ones(3, np.int32),
        sampler_logprobs=np.zeros(3, np.float32),
        version_start=np.zeros(1, np.int64),
        version_end=np.zeros(1, np.int64),
        version_spans=np.zeros((0, 2), np.int64),
        version_span_counts=np.zeros(0, np.int32),
        rewards=np.zeros(1, np.float32),
        advantages=np.zeros(1, np.float32),
        reward_terms={},
        masked=np.zeros(0, bool),
        loss_mask=np.zeros(0, bool),
    )
    with pytest.raises(ValueError, match=r"p001.*no_teacher"):
        pack_groups(groups, 0, 4096, teacher=True)
    assert len(pack_groups(groups, 0, 4096, teacher=False)[0].teacher_logprobs) == 0


def test_plan_step_refuses_mismatched_shapes_and_overlong_samples():
    with pytest.raises(ValueError, match="same shape"):
        plan_step([[3, 4]], [[1.0]], 10)
    with pytest.raises(ValueError, match="more than token_budget"):
        plan_step([[3, 40]], [[1.0, 1.0]], 10)
    assert plan_step([[3, 4], [5]], [[1.0, 0.5], [1.0]], 10) == [[(0, 1)], [(1, 0), (0, 0)]]
    # a group of exactly the budget stays one unit, in sample order; one token more splits it
    assert plan_step([[4, 6]], [[1.0, 1.0]], 10) == [[(0, 0), (0, 1)]]
    assert plan_step([[4, 7]], [[1.0, 1.0]], 10) == [[(0, 1)], [(0, 0)]]
