"""The packer's step path (packer.assemble: plan from lengths, fill micro-batch arrays straight from
the scored groups) against an independent per-sample construction (each sample's ``prompt +
completion`` arrays copied out, then concatenated; the packer's construction before
packer.assemble, kept here as the oracle): every field of every micro-batch must be byte-identical.

The groups are random but realistic and pass the wire's checks (they go through the real codec):
mixed prompt and completion lengths (empty completions included), two temperatures, multi-turn
environment tokens, samples masked by an enforced filter, partial rollouts whose tokens span several
policy versions (and groups whose sender knew no spans), teacher logprobs or not, and reward terms
whose names differ between groups.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from bus.codec import decode, encode
from bus.messages import MicroBatch, ScoredGroup
from bus.sample_arrays import sample_token_versions
from packer.assemble import fill_step, pack_groups, plan_step
from packer.packer import Packer
from packer.packing import pack_micro_batches


def reference_samples(group: ScoredGroup, teacher: bool) -> list[SimpleNamespace]:
    """Each sample of ``group`` as its own ``prompt + completion`` arrays (the oracle's first half)."""
    prompt = np.asarray(group.prompt_ids, np.int32)
    offsets = np.concatenate([[0], np.cumsum(group.completion_lens)])
    zeros = np.zeros(len(prompt), np.float32)
    model = np.asarray(group.loss_mask, bool) if len(group.loss_mask) else np.ones(len(group.completion_ids), bool)
    out = []
    for j in range(group.group_size):
        ids, lps = group.completion(j)
        lo, hi = offsets[j], offsets[j + 1]
        oldest = int(group.version_start[j])
        masked = len(group.masked) > 0 and bool(group.masked[j])
        out.append(
            SimpleNamespace(
                sample_id=f"{group.id}/{j}",
                input_ids=np.concatenate([prompt, ids]).astype(np.int32),
                loss_mask=np.concatenate([np.zeros(len(prompt), bool), model[lo:hi] & (not masked)]),
                sampler_logprobs=np.concatenate([zeros, lps]).astype(np.float32),
                advantage=float(group.advantages[j]),
                reward=float(group.rewards[j]),
                version=oldest,
                temperature=float(group.temperature),
                teacher_logprobs=np.concatenate([zeros, group.teacher_logprobs[lo:hi]]).astype(np.float32)
                if teacher
                else None,
                reward_terms={name: float(scores[j]) for name, scores in group.reward_terms.items()},
                token_versions=np.concatenate(
                    [np.full(len(prompt), oldest, np.int64), sample_token_versions(group, j)]
                ),
            )
        )
    return out


def reference_micro_batch(samples: list[SimpleNamespace], **ids) -> MicroBatch:
    """The samples concatenated into one micro-batch (the oracle's second half)."""
    names = set.intersection(*(set(s.reward_terms) for s in samples))
    return MicroBatch(
        id=f"{ids['step']}:{ids['micro_index']}",
        **ids,
        sample_ids=[s.sample_id for s in samples],
        input_ids=np.concatenate([s.input_ids for s in samples]),
        seq_lens=np.array([len(s.input_ids) for s in samples], dtype=np.int32),
        loss_mask=np.concatenate([s.loss_mask for s in samples]),
        sampler_logprobs=np.concatenate([s.sampler_logprobs for s in samples]),
        advantages=np.concatenate([np.full(len(s.input_ids), s.advantage, np.float32) for s in samples]),
        rewards=np.array([s.reward for s in samples], dtype=np.float32),
        oldest_versions=np.array([s.version for s in samples], dtype=np.int64),
        token_versions=np.concatenate([s.token_versions for s in samples]),
        teacher_logprobs=np.concatenate([s.teacher_logprobs for s in samples])
        if samples[0].teacher_logprobs is not None
        else np.zeros(0, dtype=np.float32),
        temperature=samples[0].temperature,
        reward_terms={name: [s.reward_terms[name] for s in samples] for name in sorted(names)},
    )


def reference_pack_step(groups: list[ScoredGroup], step: int, budget: int, teacher: bool) -> list[MicroBatch]:
    """The packer's step as it was built before packer.assemble (commit 9b5c977): per-sample copies,
    binned by temperature, a group that fits kept whole, each bin best-fit packed."""
    per_group = [reference_samples(g, teacher) for g in groups]
    samples = [s for g in per_group for s in g]
    loss_tokens = int(sum(s.loss_mask.sum() for s in samples))
    loss_samples = sum(1 for s in samples if s.loss_mask.any())
    bins: list[list[SimpleNamespace]] = []
    for temperature in sorted({s.temperature for s in samples}):
        units: list[list[SimpleNamespace]] = []
        for g in [[s for s in g if s.temperature == temperature] for g in per_group]:
            if g and sum(len(s.input_ids) for s in g) <= budget:
                units.append(g)
            else:
                units += [[s] for s in g]
        packed = pack_micro_batches([sum(len(s.input_ids) for s in unit) for unit in units], budget)
        bins += [[s for i in idx for s in units[i]] for idx in packed]
    counts = dict(num_micro_batches=len(bins), step_loss_tokens=loss_tokens, step_samples=loss_samples)
    return [reference_micro_batch(b, step=step, micro_index=k, **counts) for k, b in enumerate(bins)]


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
        ref = reference_pack_step(groups, 7, budget, teacher)
        assert any(len(mb.sample_ids) > 1 for mb in ref)
        packer = Packer(len(groups), 8, budget, teacher=teacher)
        assert_identical(packer.pack(groups, 7), ref)
        # the same plan through fill_step (the tests' and benches' way to a chosen split): the same micro-batches
        lengths = [[len(g.prompt_ids) + n for n in g.completion_lens.tolist()] for g in groups]
        plan = plan_step(lengths, [[g.temperature] * g.group_size for g in groups], budget)
        assert_identical(fill_step(groups, plan, 7, teacher=teacher), ref)


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
