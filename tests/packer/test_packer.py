"""Tests for packer.packer: staleness filter, whole-step accounting and padding-free packing.

Groups are built by hand with traceable values: token ids, logprobs and advantages are chosen so
that every packed token can be checked against the sample it must come from.
"""

from __future__ import annotations

import numpy as np
import pytest

from bus.codec import decode, encode
from bus.messages import MicroBatch, ScoredGroup
from packer.assemble import fill_micro_batch, pack_groups
from packer.packer import Packer, rewards_all_equal, rewards_all_zero_or_all_one
from tests.scored_groups import packed_step, scored


def simple(gid: str, version: int = 0, prompt_len: int = 2, comp_len: int = 2, g: int = 2) -> ScoredGroup:
    """A group that passes every check at step ``version`` (rewards differ: not filtered)."""
    rewards = [j / g for j in range(g)]
    return scored(
        gid, list(range(1, prompt_len + 1)), [[50 + j] * comp_len for j in range(g)], version=version, rewards=rewards
    )


def split_samples(mb: MicroBatch) -> dict[str, dict[str, np.ndarray]]:
    """Per-sample slices of a micro-batch, keyed by sample id (positions restart per sample)."""
    out = {}
    ends = np.cumsum(mb.seq_lens)
    starts = ends - mb.seq_lens
    for sid, s, e in zip(mb.sample_ids, starts, ends):
        out[sid] = {
            "input_ids": mb.input_ids[s:e],
            "loss_mask": mb.loss_mask[s:e],
            "sampler_logprobs": mb.sampler_logprobs[s:e],
            "advantages": mb.advantages[s:e],
        }
    return out


def check_step(batches: list[MicroBatch], budget: int, step: int) -> list[str]:
    """Structural invariants of one emitted step; returns all sample ids in packing order."""
    assert batches, "a step has at least one micro-batch"
    n = len(batches)
    ids = []
    for k, mb in enumerate(batches):
        assert mb.step == step and mb.micro_index == k and mb.num_micro_batches == n
        assert mb.id == f"{step}:{k}"
        assert len(mb.input_ids) <= budget
        assert int(mb.seq_lens.sum()) == len(mb.input_ids)
        assert len(mb.sample_ids) == len(mb.seq_lens) == len(mb.rewards) == len(mb.oldest_versions)
        assert len(mb.loss_mask) == len(mb.sampler_logprobs) == len(mb.advantages) == len(mb.input_ids)
        assert mb.step_loss_tokens == batches[0].step_loss_tokens
        ids.extend(mb.sample_ids)
    assert len(ids) == len(set(ids)), "no sample twice"
    assert sum(int(mb.loss_mask.sum()) for mb in batches) == batches[0].step_loss_tokens
    return ids


# ------------------------------------------------------------------------------------------------
# one micro-batch by hand (packer.assemble.fill_step)
# ------------------------------------------------------------------------------------------------


def test_a_groups_samples_by_hand():
    g = scored("g", [7, 8], [[10, 11, 12], [20]], version=[3, 2], advantages=[1.5, -1.5], rewards=[1.0, 0.0])
    (mb,) = packed_step([g])
    s0, s1 = split_samples(mb)["g/0"], split_samples(mb)["g/1"]
    assert mb.sample_ids == ["g/0", "g/1"] and mb.input_ids.dtype == np.int32
    assert s0["input_ids"].tolist() == [7, 8, 10, 11, 12]
    assert s0["loss_mask"].tolist() == [False, False, True, True, True]
    np.testing.assert_array_equal(s0["sampler_logprobs"], np.float32([0, 0, -0.010, -0.011, -0.012]))
    assert s1["input_ids"].tolist() == [7, 8, 20]
    assert s1["loss_mask"].tolist() == [False, False, True]
    np.testing.assert_array_equal(s1["sampler_logprobs"], np.float32([0, 0, -0.020]))
    assert s0["advantages"].tolist() == [1.5] * 5 and s1["advantages"].tolist() == [-1.5] * 3
    assert mb.rewards.tolist() == [1.0, 0.0] and mb.oldest_versions.tolist() == [3, 2]


def test_a_zero_length_completion():
    g = scored("g", [7, 8], [[], [30, 31]])
    (mb,) = packed_step([g])
    s0, s1 = split_samples(mb)["g/0"], split_samples(mb)["g/1"]
    assert s0["input_ids"].tolist() == [7, 8] and s0["loss_mask"].tolist() == [False, False]
    assert s0["sampler_logprobs"].tolist() == [0.0, 0.0] and mb.sampler_logprobs.dtype == np.float32
    assert s1["input_ids"].tolist() == [7, 8, 30, 31]


def test_a_micro_batch_by_hand():
    a = scored("a", [1], [[2, 3]], logprobs=[[-0.5, -0.25]], advantages=[2.0], rewards=[1.0], version=4)
    b = scored("b", [9], [[7], [8]], logprobs=[[-2.0], [-1.0]], advantages=[0.0, -1.0], rewards=[0.5, 0.0], version=5)
    kw = dict(micro_index=1, num_micro_batches=3, step_loss_tokens=10, step_samples=5)
    mb = fill_micro_batch([a, b], [(0, 0), (1, 1)], teacher=False, step=6, **kw)
    assert mb.id == "6:1" and mb.step == 6 and mb.micro_index == 1 and mb.num_micro_batches == 3
    assert mb.step_loss_tokens == 10 and mb.step_samples == 5 and mb.sample_ids == ["a/0", "b/1"]
    assert mb.teacher_logprobs.shape == (0,)  # no teacher
    assert mb.input_ids.tolist() == [1, 2, 3, 9, 8]
    assert mb.seq_lens.tolist() == [3, 2]
    assert mb.loss_mask.tolist() == [False, True, True, False, True]
    assert mb.sampler_logprobs.tolist() == [0, -0.5, -0.25, 0, -1.0]
    assert mb.advantages.tolist() == [2.0, 2.0, 2.0, -1.0, -1.0]  # advantage on every token of its sample
    assert mb.rewards.tolist() == [1.0, 0.0] and mb.oldest_versions.tolist() == [4, 5]
    assert decode(encode(mb)).input_ids.tolist() == mb.input_ids.tolist()  # validates (check())


# ------------------------------------------------------------------------------------------------
# Packer
# ------------------------------------------------------------------------------------------------


def test_constructor_rejects_bad_bounds():
    for args in ((0, 1, 10), (1, -1, 10), (1, 1, 0)):
        with pytest.raises(ValueError):
            Packer(*args)


def test_step_only_when_full_and_in_arrival_order():
    p = Packer(prompts_per_step=2, max_off_policy_steps=5, micro_batch_tokens=100)
    assert p.add(simple("g0")) == (True, "")
    assert p.pop_step() == ([], [])  # one group of two: not ready
    for gid in ("g1", "g2", "g3", "g4"):
        assert p.add(simple(gid)) == (True, "")
    b0, d0 = p.pop_step()
    b1, d1 = p.pop_step()
    b2, d2 = p.pop_step()
    assert d0 == d1 == d2 == []
    ids0 = check_step(b0, 100, step=0)
    ids1 = check_step(b1, 100, step=1)
    assert sorted(ids0) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    assert sorted(ids1) == ["g2/0", "g2/1", "g3/0", "g3/1"]
    assert b2 == [] and [g.id for g in p.buffer] == ["g4"] and p.next_step == 2


def test_packing_by_hand_and_token_alignment():
    # A: prompt [1, 2], completions [10,11,12] (len 5) and [13] (len 3)
    # B: prompt [3],    completions [20,21,22,23] (len 5) and [] (len 1, zero-length completion)
    # Budget 6: group A (5 + 3 = 8 tokens) does not fit, so its samples are packed one by one;
    # group B (5 + 1 = 6) fits and is one unit (its samples stay adjacent, for the trainer's
    # shared-prefix forward). BFD over the units [A0=5, A1=3, B=6] by decreasing size:
    # B -> bin0 (room 0); A0 -> bin1 (room 1); A1 -> bin2 (room 3)
    # => bins [[B0, B1], [A0], [A1]]; loss tokens = 3 + 1 + 4 + 0 = 8.
    a = scored("A", [1, 2], [[10, 11, 12], [13]], version=0, advantages=[0.7, -0.7], rewards=[0.9, 0.1])
    b = scored("B", [3], [[20, 21, 22, 23], []], version=1, advantages=[1.0, -1.0], rewards=[1.0, 0.0])
    p = Packer(prompts_per_step=2, max_off_policy_steps=1, micro_batch_tokens=6, first_step=1)
    assert p.add(a) == (True, "") and p.add(b) == (True, "")
    batches, dropped = p.pop_step()
    assert dropped == []
    check_step(batches, 6, step=1)
    assert [mb.sample_ids for mb in batches] == [["B/0", "B/1"], ["A/0"], ["A/1"]]
    assert [mb.seq_lens.tolist() for mb in batches] == [[5, 1], [5], [3]]
    assert all(mb.step_loss_tokens == 8 for mb in batches)
    assert all(mb.step_samples == 3 for mb in batches)  # B/1 has no completion token: not counted
    assert batches[0].input_ids.tolist() == [3, 20, 21, 22, 23, 3]
    assert batches[0].loss_mask.tolist() == [False, True, True, True, True, False]
    np.testing.assert_array_equal(batches[0].sampler_logprobs, np.float32([0, -0.020, -0.021, -0.022, -0.023, 0]))
    np.testing.assert_array_equal(batches[0].advantages, np.float32([1.0] * 5 + [-1.0]))
    np.testing.assert_array_equal(batches[0].rewards, np.float32([1.0, 0.0]))
    assert batches[0].oldest_versions.tolist() == [1, 1]
    assert batches[1].input_ids.tolist() == [1, 2, 10, 11, 12]
    assert batches[1].loss_mask.tolist() == [False, False, True, True, True]
    np.testing.assert_array_equal(batches[1].sampler_logprobs, np.float32([0, 0, -0.010, -0.011, -0.012]))
    assert batches[2].input_ids.tolist() == [1, 2, 13]
    np.testing.assert_array_equal(batches[2].advantages, np.float32([-0.7] * 3))
    for mb in batches:  # every message survives the wire and validates
        back = decode(encode(mb))
        assert isinstance(back, MicroBatch) and back.sample_ids == mb.sample_ids
        for name in (
            "input_ids",
            "seq_lens",
            "loss_mask",
            "sampler_logprobs",
            "advantages",
            "rewards",
            "oldest_versions",
        ):
            np.testing.assert_array_equal(getattr(back, name), getattr(mb, name))
        assert (back.step, back.micro_index, back.num_micro_batches, back.step_loss_tokens) == (
            mb.step,
            mb.micro_index,
            mb.num_micro_batches,
            mb.step_loss_tokens,
        )


def test_many_groups_every_sample_once_and_aligned():
    rng = np.random.default_rng(0)
    groups = []
    for i in range(4):
        prompt = rng.integers(1, 100, size=int(rng.integers(1, 6))).tolist()
        comps = [rng.integers(100, 999, size=int(rng.integers(0, 9))).tolist() for _ in range(3)]
        groups.append(scored(f"g{i}", prompt, comps, advantages=list(rng.normal(size=3)), rewards=[0.1, 0.2, 0.3]))
    budget = 16
    p = Packer(prompts_per_step=4, max_off_policy_steps=0, micro_batch_tokens=budget)
    for g in groups:
        assert p.add(g) == (True, "")
    batches, _ = p.pop_step()
    ids = check_step(batches, budget, step=0)
    assert sorted(ids) == sorted(f"g{i}/{j}" for i in range(4) for j in range(3))
    expected_loss = sum(int(g.completion_lens.sum()) for g in groups)
    assert batches[0].step_loss_tokens == expected_loss
    by_id = {sid: v for mb in batches for sid, v in split_samples(mb).items()}
    for g in groups:
        for j in range(3):
            comp, lps = g.completion(j)
            got = by_id[f"{g.id}/{j}"]
            n_p = len(g.prompt_ids)
            assert got["input_ids"].tolist() == g.prompt_ids.tolist() + comp.tolist()
            assert got["loss_mask"].tolist() == [False] * n_p + [True] * len(comp)
            np.testing.assert_array_equal(got["sampler_logprobs"][n_p:], lps)
            assert (got["sampler_logprobs"][:n_p] == 0).all()
            assert (got["advantages"] == g.advantages[j]).all()


def test_stale_on_add_boundary_uses_oldest_version():
    # next_step 3, max lag 1: version 2 is lag 1 (ok), version 1 is lag 2 (stale); min over samples.
    p = Packer(prompts_per_step=1, max_off_policy_steps=1, micro_batch_tokens=100, first_step=3)
    assert p.add(simple("ok", version=2)) == (True, "")
    assert p.add(scored("mixed", [1], [[5], [6]], version=[3, 1])) == (False, "stale")
    assert p.add(simple("old", version=0)) == (False, "stale")
    assert [g.id for g in p.buffer] == ["ok"]
    # a stale group sent again is a duplicate, so it is never reported twice
    assert p.add(simple("old", version=0)) == (False, "duplicate")


def test_buffered_group_goes_stale_and_is_never_emitted():
    # max lag 0: a version-0 group may train only at step 0.
    p = Packer(prompts_per_step=2, max_off_policy_steps=0, micro_batch_tokens=100)
    for gid in ("A", "B", "C"):
        assert p.add(simple(gid, version=0)) == (True, "")
    b0, d0 = p.pop_step()
    assert sorted(check_step(b0, 100, step=0)) == ["A/0", "A/1", "B/0", "B/1"] and d0 == []
    # now next_step = 1 and C (version 0) has lag 1 > 0 while waiting
    batches, dropped = p.pop_step()
    assert batches == [] and [g.id for g in dropped] == ["C"]
    assert len(p.buffer) == 0
    assert p.pop_step() == ([], [])  # reported once
    assert p.add(simple("D", version=1)) == (True, "")
    assert p.pop_step() == ([], [])  # C no longer counts toward the step
    assert p.add(simple("E", version=1)) == (True, "")
    b1, d1 = p.pop_step()
    assert d1 == [] and sorted(check_step(b1, 100, step=1)) == ["D/0", "D/1", "E/0", "E/1"]


def test_stale_dropped_and_step_emitted_in_same_pop():
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100)
    assert p.add(simple("A", version=0)) == (True, "")
    assert p.add(simple("B", version=0)) == (True, "")
    assert p.add(simple("C", version=1)) == (True, "")  # version ahead of step: lag -1 is fine
    b0, _ = p.pop_step()
    assert {s.split("/")[0] for s in check_step(b0, 100, 0)} == {"A"}
    b1, d1 = p.pop_step()  # step 1: B (lag 1) dropped, C emitted
    assert [g.id for g in d1] == ["B"]
    assert {s.split("/")[0] for s in check_step(b1, 100, 1)} == {"C"}


def test_duplicate_refused_even_after_emission():
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100)
    g = simple("A")
    assert p.add(g) == (True, "")
    assert p.add(simple("A")) == (False, "duplicate")
    assert len(p.buffer) == 1
    p.pop_step()
    assert p.add(g) == (False, "duplicate")
    assert p.pop_step() == ([], [])


def test_too_long_boundary():
    # budget 10: prompt 4 + completion 6 = 10 fits exactly; prompt 4 + 7 = 11 does not
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=10)
    assert p.add(scored("long", [1, 2, 3, 4], [[5] * 6, [6] * 7])) == (False, "too_long")
    assert p.add(scored("fit", [1, 2, 3, 4], [[5] * 6, [6] * 1])) == (True, "")
    batches, _ = p.pop_step()
    check_step(batches, 10, 0)
    assert [mb.seq_lens.tolist() for mb in batches] == [[10], [5]]


def test_all_zero_length_completions():
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=8)
    assert p.add(scored("z", [1, 2, 3], [[], []])) == (True, "")
    batches, _ = p.pop_step()
    check_step(batches, 8, 0)
    # two 3-token samples fit one bin: [1,2,3,1,2,3], no loss token at all
    assert len(batches) == 1 and batches[0].input_ids.tolist() == [1, 2, 3, 1, 2, 3]
    assert batches[0].step_loss_tokens == 0 and batches[0].step_samples == 0 and not batches[0].loss_mask.any()
    assert decode(encode(batches[0])).step_loss_tokens == 0


def test_scored_group_input_survives_wire():
    g = scored("A", [1, 2], [[10, 11], []], version=[1, 2], advantages=[1.0, -1.0], rewards=[1.0, 0.0])
    back = decode(encode(g))
    assert isinstance(back, ScoredGroup)
    p1 = Packer(prompts_per_step=1, max_off_policy_steps=2, micro_batch_tokens=50, first_step=2)
    p2 = Packer(prompts_per_step=1, max_off_policy_steps=2, micro_batch_tokens=50, first_step=2)
    assert p1.add(g) == p2.add(back) == (True, "")
    (m1,), _ = p1.pop_step()
    (m2,), _ = p2.pop_step()
    assert m1.sample_ids == m2.sample_ids
    np.testing.assert_array_equal(m1.input_ids, m2.input_ids)
    np.testing.assert_array_equal(m1.sampler_logprobs, m2.sampler_logprobs)
    np.testing.assert_array_equal(m1.oldest_versions, np.int64([1, 2]))


# ------------------------------------------------------------------------------------------------
# filtering and run-wide dedupe (at-least-once delivery upstream)
# ------------------------------------------------------------------------------------------------


def test_rewards_all_equal():
    assert rewards_all_equal(np.float32([1.0, 1.0, 1.0]))
    assert rewards_all_equal(np.float32([0.0, 0.0]))
    assert rewards_all_equal(np.float32([0.25]))  # G = 1: no group-relative signal at all
    assert not rewards_all_equal(np.float32([1.0, 1.0, 0.999]))
    assert not rewards_all_equal(np.float32([0.0, 1.0]))


def test_filter_equal_rewards_drops_with_its_reason_only_when_enabled():
    same = scored("same", [1], [[5], [6]], rewards=[1.0, 1.0])
    mixed = scored("mixed", [1], [[5], [6]], rewards=[1.0, 0.0], advantages=[1.0, -1.0])
    on = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100, filter_equal_rewards=True)
    assert on.add(same) == (False, "filtered: equal_rewards")
    assert on.add(mixed) == (True, "")
    assert [g.id for g in on.buffer] == ["mixed"]
    off = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100)
    assert off.add(same) == (True, "")


def test_content_verdicts_come_before_staleness():
    # a stale group that is also filtered / too long / empty gets the verdict that cannot change
    p = Packer(
        prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=8, first_step=5, filter_equal_rewards=True
    )
    assert p.add(scored("eq", [1], [[5], [6]], version=0, rewards=[0.0, 0.0])) == (False, "filtered: equal_rewards")
    assert p.add(scored("long", [1], [[5] * 8, [6]], version=0, rewards=[0.0, 1.0])) == (False, "too_long")
    assert p.add(scored("empty", [], [[5], [6]], version=0, rewards=[0.0, 1.0])) == (False, "empty_prompt")
    assert p.add(scored("old", [1], [[5], [6]], version=0, rewards=[0.0, 1.0])) == (False, "stale")


def test_every_group_id_gets_one_decision_for_the_whole_run():
    """Redelivery can bring a group back at any later time, whatever happened to it: it must
    never train twice nor get a second verdict (the seen-id set is never trimmed)."""
    p = Packer(prompts_per_step=2, max_off_policy_steps=0, micro_batch_tokens=100, filter_equal_rewards=True)
    first = {
        "t0": simple("t0"),
        "t1": simple("t1"),  # trained in step 0
        "eq": scored("eq", [1], [[5], [6]], rewards=[1.0, 1.0]),  # filtered
        "big": scored("big", [1], [[5] * 200, [6]], rewards=[0.0, 1.0]),  # too long
        "late": simple("late"),  # buffered, then stale at step 1
    }
    verdicts = {gid: p.add(g) for gid, g in first.items()}
    assert verdicts == {
        "t0": (True, ""),
        "t1": (True, ""),
        "eq": (False, "filtered: equal_rewards"),
        "big": (False, "too_long"),
        "late": (True, ""),
    }
    b0, _ = p.pop_step()
    assert {s.split("/")[0] for s in check_step(b0, 100, 0)} == {"t0", "t1"}
    b1, dropped = p.pop_step()
    assert b1 == [] and [g.id for g in dropped] == ["late"]
    # many steps later every one of them arrives again (a reward worker re-sends after a restart),
    # now with rewards that would pass the filter and fresh versions that would not be stale
    for _ in range(3):
        assert p.add(simple("x%d" % p.next_step, version=p.next_step))[0]
        assert p.add(simple("y%d" % p.next_step, version=p.next_step))[0]
        batches, _ = p.pop_step()
        check_step(batches, 100, p.next_step - 1)
    for gid in first:
        assert p.add(simple(gid, version=p.next_step)) == (False, "duplicate")
    assert len(p.buffer) == 0 and p.pop_step() == ([], [])


# ------------------------------------------------------------------------------------------------
# temperature bins, teacher logprobs, masked samples, reward terms, difficulty filter, eval groups
# ------------------------------------------------------------------------------------------------


def test_temperatures_are_never_mixed_in_a_micro_batch():
    # 4 groups of 2 samples of 4 tokens at T = 1.0, 0.7, 1.0, 0.7 (a temp_scheduler straddling a
    # step); budget 16 holds 4 samples: one micro-batch per temperature, never 2 full mixed ones
    temps = [1.0, 0.7, 1.0, 0.7]
    groups = [
        scored(f"g{i}", [1, 2], [[10 + i] * 2, [20 + i] * 2], rewards=[0.0, 1.0], temperature=t)
        for i, t in enumerate(temps)
    ]
    p = Packer(prompts_per_step=4, max_off_policy_steps=0, micro_batch_tokens=16)
    for g in groups:
        assert p.add(g) == (True, "")
    batches, _ = p.pop_step()
    check_step(batches, 16, step=0)
    assert [mb.temperature for mb in batches] == [0.7, 1.0]  # ascending
    assert [sorted(mb.sample_ids) for mb in batches] == [
        ["g1/0", "g1/1", "g3/0", "g3/1"],
        ["g0/0", "g0/1", "g2/0", "g2/1"],
    ]
    assert all(mb.step_loss_tokens == 16 and mb.step_samples == 8 for mb in batches)  # the whole step
    assert [decode(encode(mb)).temperature for mb in batches] == [0.7, 1.0]
    # unbalanced bins: 3 samples at 0.7 and 1 at 1.0, budget 8 (2 samples): 0.7 needs 2 bins
    q = Packer(prompts_per_step=2, max_off_policy_steps=0, micro_batch_tokens=8)
    q.add(scored("a", [1, 2], [[5, 5], [6, 6], [7, 7]], rewards=[0, 1, 0], temperature=0.7))
    q.add(scored("b", [1, 2], [[8, 8]], rewards=[1.0], temperature=1.0))
    batches, _ = q.pop_step()
    check_step(batches, 8, step=0)
    assert [(mb.temperature, len(mb.sample_ids)) for mb in batches] == [(0.7, 2), (0.7, 1), (1.0, 1)]
    assert all(mb.num_micro_batches == 3 for mb in batches)


def test_a_micro_batch_refuses_mixed_temperatures_or_a_missing_teacher():
    a = scored("a", [1], [[2]], logprobs=[[-0.5]], rewards=[1.0], temperature=0.7)
    b = scored("b", [1], [[2]], logprobs=[[-0.5]], rewards=[1.0], temperature=1.0)
    t = scored("t", [1], [[2]], logprobs=[[-0.5]], rewards=[1.0], temperature=0.7, teacher_logprobs=np.float32([-0.1]))
    kw = dict(step=0, micro_index=0, num_micro_batches=1, step_loss_tokens=2, step_samples=2)
    with pytest.raises(ValueError, match="share a temperature"):
        fill_micro_batch([a, b], [(0, 0), (1, 0)], teacher=False, **kw)
    with pytest.raises(ValueError, match="teacher logprobs"):
        fill_micro_batch([t, a], [(0, 0), (1, 0)], teacher=True, **kw)
    with pytest.raises(ValueError, match="at least one sample"):
        fill_micro_batch([a], [], teacher=False, **kw)


def teacher_lps(completions: list[list[int]]) -> np.ndarray:
    """Teacher logprob of completion token t: ``-t / 100`` (traceable, unlike the sampler's /1000)."""
    return np.float32([-t / 100 for c in completions for t in c])


def test_teacher_logprobs_sit_on_their_completion_tokens():
    comps_a, comps_b = [[10, 11, 12], [13]], [[20, 21], []]
    a = scored("A", [1, 2], comps_a, rewards=[1.0, 0.0], teacher_logprobs=teacher_lps(comps_a))
    b = scored("B", [3], comps_b, rewards=[1.0, 0.0], teacher_logprobs=teacher_lps(comps_b))
    p = Packer(prompts_per_step=2, max_off_policy_steps=0, micro_batch_tokens=8, teacher=True)
    assert p.add(a) == (True, "") and p.add(b) == (True, "")
    batches, _ = p.pop_step()
    check_step(batches, 8, step=0)
    for mb in batches:
        back = decode(encode(mb))
        assert back.teacher_logprobs.shape == back.input_ids.shape and back.teacher_logprobs.dtype == np.float32
        expected = np.where(mb.loss_mask, -mb.input_ids / 100, 0.0).astype(np.float32)
        np.testing.assert_array_equal(back.teacher_logprobs, expected)  # 0 on prompt tokens
    assert sum(int((mb.teacher_logprobs != 0).sum()) for mb in batches) == 6  # every completion token


def test_a_group_without_teacher_logprobs_is_dropped_when_the_run_has_a_teacher():
    comps = [[10, 11], [12]]
    without = scored("without", [1], comps, rewards=[1.0, 0.0])
    with_ = scored("with", [1], comps, rewards=[1.0, 0.0], teacher_logprobs=teacher_lps(comps))
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=8, teacher=True)
    assert p.add(without) == (False, "no_teacher")
    assert p.add(with_) == (True, "")
    with pytest.raises(ValueError, match="no teacher logprobs"):
        pack_groups([without], 0, 8, teacher=True)
    # no teacher in the run: teacher logprobs a group happens to carry are not packed
    q = Packer(prompts_per_step=2, max_off_policy_steps=0, micro_batch_tokens=8)
    assert q.add(scored("w2", [1], comps, rewards=[1.0, 0.0], teacher_logprobs=teacher_lps(comps))) == (True, "")
    assert q.add(scored("wo2", [1], comps, rewards=[1.0, 0.0])) == (True, "")
    batches, _ = q.pop_step()
    assert all(mb.teacher_logprobs.shape == (0,) for mb in batches)


def test_masked_samples_train_nothing_and_are_not_counted():
    g = scored(
        "m",
        [1, 2],
        [[10, 11, 12], [20, 21], [30]],
        rewards=[1.0, 0.0, 0.5],
        advantages=[1.0, -1.0, 0.0],
        masked=np.array([False, True, False]),
        flags=["", "repetition", ""],
    )
    by_id = split_samples(packed_step([g])[0])
    assert by_id["m/0"]["loss_mask"].tolist() == [False, False, True, True, True]
    assert by_id["m/1"]["loss_mask"].tolist() == [False] * 4  # masked: still in the row, no loss token
    assert by_id["m/2"]["loss_mask"].tolist() == [False, False, True]
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=16)
    assert p.add(g) == (True, "")
    batches, _ = p.pop_step()
    ids = check_step(batches, 16, step=0)
    assert sorted(ids) == ["m/0", "m/1", "m/2"]
    assert batches[0].step_loss_tokens == 4 and batches[0].step_samples == 2


def test_reward_terms_travel_per_sample():
    g = scored(
        "r",
        [1],
        [[10], [11], [12]],
        rewards=[1.5, 0.5, 0.0],
        reward_terms={"gsm8k": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]},
    )
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=16)
    p.add(g)
    (mb,), _ = p.pop_step()
    by_sample = {sid: {k: v[i] for k, v in mb.reward_terms.items()} for i, sid in enumerate(mb.sample_ids)}
    assert by_sample == {
        "r/0": {"format": 1.0, "gsm8k": 1.0},
        "r/1": {"format": 1.0, "gsm8k": 0.0},
        "r/2": {"format": 0.0, "gsm8k": 0.0},
    }
    assert decode(encode(mb)).reward_terms == mb.reward_terms
    # a micro-batch keeps only the names every one of its samples carries
    other = scored("o", [1], [[2]], rewards=[1.0], reward_terms={"gsm8k": [1.0]})
    (mixed,) = packed_step([g, other], [[0, 3]])
    assert mixed.reward_terms == {"gsm8k": [1.0, 1.0]}


def test_online_difficulty_filtering():
    assert rewards_all_zero_or_all_one(np.float32([0.0, 0.0, 0.0]))
    assert rewards_all_zero_or_all_one(np.float32([1.0, 1.0]))
    assert not rewards_all_zero_or_all_one(np.float32([0.5, 0.5]))  # equal, but neither 0 nor 1
    assert not rewards_all_zero_or_all_one(np.float32([0.0, 1.0]))
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100, online_difficulty_filtering=True)
    assert p.add(scored("zeros", [1], [[5], [6]], rewards=[0.0, 0.0])) == (False, "filtered: online_difficulty")
    assert p.add(scored("ones", [1], [[5], [6]], rewards=[1.0, 1.0])) == (False, "filtered: online_difficulty")
    assert p.add(scored("halves", [1], [[5], [6]], rewards=[0.5, 0.5])) == (True, "")
    assert p.add(scored("mixed", [1], [[5], [6]], rewards=[0.0, 1.0])) == (True, "")
    off = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100)
    assert off.add(scored("zeros", [1], [[5], [6]], rewards=[0.0, 0.0])) == (True, "")


def test_eval_groups_are_refused():
    p = Packer(prompts_per_step=1, max_off_policy_steps=0, micro_batch_tokens=100)
    g = scored("e000000-reverse_text-00000", [1], [[5], [6]], rewards=[0.0, 1.0], eval_round=0, eval_size=1)
    with pytest.raises(ValueError, match="eval group"):
        p.add(g)
    assert p.seen == set() and not p.buffer


def test_groups_that_fit_stay_whole_and_adjacent():
    # Lengths differ inside each group, so packing sample by sample (longest first) would spread
    # every group over the micro-batches; a group that fits the budget is one unit instead, and
    # the trainer can run its prompt once (trainer.forward.shared_prefix).
    groups = [
        scored(
            g,
            [1, 2, 3],
            [[4] * n for n in (1, 6, 2, 5)],
            version=0,
            advantages=[0.1, -0.1, 0.2, -0.2],
            rewards=[0.5] * 4,
        )
        for g in ("G0", "G1", "G2")
    ]
    p = Packer(prompts_per_step=3, max_off_policy_steps=1, micro_batch_tokens=40)
    for g in groups:
        assert p.add(g) == (True, "")
    batches, _dropped = p.pop_step()
    check_step(batches, 40, step=0)
    placed = {}
    for k, mb in enumerate(batches):
        groups_here = [sid.rpartition("/")[0] for sid in mb.sample_ids]
        for g in set(groups_here):
            first = groups_here.index(g)
            assert groups_here[first : first + 4] == [g] * 4, mb.sample_ids  # whole and adjacent
            placed[g] = k
    assert sorted(placed) == ["G0", "G1", "G2"]
