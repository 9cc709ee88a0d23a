"""Tests for prompts.source.PromptSource (the socket-free logic): gating by the producers'
applied versions and the async level (also with producers that depart, return or go back to an
older version), replacements for prompts that did not train, the end of the run, ids and cycling,
and the rebuild of a restarted source from its ledger journal. The process on real sockets:
``test_prompt_source_proc.py``."""

from __future__ import annotations

import json

import pytest

from bus.eval_ids import is_eval_id
from bus.codec import decode, encode
from bus.messages import Prompt
from configs.schema import load_config
from prompts.accounting import Ledger
from prompts.applied_versions import AppliedVersions, applied_since_start
from prompts.eval_rounds import EvalRounds, EvalSet
from prompts.source import PromptSource
from prompts.temperature import temperature_at
from tasks.registry import load_task_examples


class Clock:
    """Monotonic time that a test moves by hand, seconds."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def examples():
    return load_task_examples("reverse_text", "train", 3, 0)


def drain(src: PromptSource, limit: int = 1000) -> list[Prompt]:
    """Issue prompts while allowed."""
    out = []
    while src.may_issue():
        out.append(src.issue())
        assert len(out) < limit, "gating never closed"
    return out


def make(
    examples, *, pps=2, level=1, max_steps=100, producers=1, dead_after_s=10.0, ledger=None, clock=None, **kwargs
) -> PromptSource:
    return PromptSource(
        examples,
        task="reverse_text",
        prompts_per_step=pps,
        max_async_level=level,
        max_steps=max_steps,
        num_producers=producers,
        dead_after_s=dead_after_s,
        ledger=ledger,
        clock=clock or Clock(),
        **kwargs,
    )


def test_gating_by_async_level(examples):
    src = make(examples, pps=2, level=1)
    # version 0, level 1: steps s with 0 >= s - 1, i.e. s in {0, 1}: 2 * 2 = 4 prompts
    first = drain(src)
    assert [p.step for p in first] == [0, 0, 1, 1]
    assert not src.may_issue()
    src.on_weights_applied("producer-0", 1)  # now step 2 too
    second = drain(src)
    assert [p.step for p in second] == [2, 2]
    assert not src.may_issue()
    src.on_weights_applied("producer-0", 3)  # steps 3 and 4
    assert [p.step for p in drain(src)] == [3, 3, 4, 4]


def test_prefetch_issues_steps_beyond_the_gate(examples):
    src = make(examples, pps=2, level=1, prefetch_steps=1)
    # version 0, level 1, one step of prefetch: steps s with 0 >= s - 2 (the producers hold step 2)
    assert [p.step for p in drain(src)] == [0, 0, 1, 1, 2, 2]
    src.on_weights_applied("producer-0", 1)
    assert [p.step for p in drain(src)] == [3, 3]
    with pytest.raises(ValueError, match="prefetch_steps"):
        make(examples, prefetch_steps=-1)


def test_async_level_zero_is_synchronous(examples):
    src = make(examples, pps=3, level=0)
    assert [p.step for p in drain(src)] == [0, 0, 0]
    src.on_weights_applied("producer-0", 1)
    assert [p.step for p in drain(src)] == [1, 1, 1]


def test_dropped_groups_are_replaced_for_the_same_step(examples):
    src = make(examples, pps=2, level=1)
    first = drain(src)  # 4 prompts: steps 0, 0, 1, 1
    assert src.on_dropped([first[3].id], "stale") == 1  # (4 - 1) // 2 = 1: one replacement for step 1
    repl = drain(src)
    assert [p.step for p in repl] == [1]
    assert repl[0].index == 4 and repl[0].id == "p00000004"
    # both of step 0's prompts and step 1's replacement go: step 0 needs two, step 1 one (each drop's own step)
    assert src.on_dropped([first[0].id], "filtered: equal_rewards") == 1
    assert src.on_dropped([first[1].id, repl[0].id], "failed: RuntimeError") == 2
    assert [p.step for p in drain(src)] == [0, 0, 1]
    assert not src.may_issue()


def test_an_on_policy_run_replaces_a_drop_in_its_own_step_after_prefetching(examples):
    """max_async_level=0 with a prefetched step: a step-0 prompt that fails after step 1 was issued is replaced
    for step 0 (a step-1 tag would be held until version 1, which needs step 0: a deadlock, seen in a run)."""
    src = make(examples, pps=2, level=0, prefetch_steps=1)
    first = drain(src)
    assert [p.step for p in first] == [0, 0, 1, 1]
    assert src.on_dropped([first[1].id], "failed: VLLMValidationError") == 1
    assert [p.step for p in drain(src)] == [0]


def test_repeats_conflicts_and_unknown_ids_owe_no_replacement(examples):
    src = make(examples, pps=2, level=0)
    a, b = drain(src)
    assert src.on_dropped([a.id], "stale") == 1
    assert src.on_dropped([a.id], "stale") == 0  # the same announcement again (at-least-once)
    assert src.on_trained([a.id]) == 0  # a conflict: the first outcome stands
    assert src.on_dropped(["p99999999", "junk"], "too_long") == 0  # never issued
    assert [p.id for p in drain(src)] == ["p00000002"]  # exactly one replacement
    assert src.on_trained([b.id, "p00000002"]) == 2
    assert not src.may_issue()  # step 0 is complete; step 1 waits for version 1
    acc = src.ledger.accounting()
    assert acc["num_conflicts"] == 1 and acc["num_unknown"] == 2 and acc["num_repeats"] == 1
    assert acc["outcomes"] == {"trained": 2, "dropped_stale": 1, "filtered": 0, "failed": 0}


def test_nothing_issued_for_step_at_or_beyond_max_steps(examples):
    src = make(examples, pps=2, level=10, max_steps=2)
    prompts = drain(src)  # steps 0 and 1 only, whatever the async level
    assert [p.step for p in prompts] == [0, 0, 1, 1]
    src.on_weights_applied("producer-0", 50)
    assert not src.may_issue()
    src.on_dropped([prompts[3].id], "stale")  # a dropped group of the last step is still replaced
    assert [p.step for p in drain(src)] == [1]
    assert not src.may_issue()
    with pytest.raises(AssertionError):
        src.issue()


def test_ids_indices_and_cycling(examples):
    src = make(examples, pps=1, level=100, max_steps=7)
    prompts = drain(src)
    assert len(prompts) == 7
    assert [p.id for p in prompts] == [f"p{i:08d}" for i in range(7)]
    assert len({p.id for p in prompts}) == 7
    assert [p.index for p in prompts] == list(range(7))
    assert [p.step for p in prompts] == list(range(7))
    # 3 examples cycle: prompt i uses example i % 3
    for i, p in enumerate(prompts):
        ex = examples[i % 3]
        assert p.task == "reverse_text"
        assert p.messages == [{"role": "user", "content": ex["prompt"]}]
        assert p.info == {"target": ex["prompt"][::-1]}
    assert prompts[0].info is not examples[0]["info"]  # a copy: downstream cannot mutate the dataset


def test_newest_announcement_wins_also_when_lower(examples):
    # a trainer that resumed from its checkpoint announces an older version: the gate follows it
    src = make(examples, pps=1, level=0)
    src.on_weights_applied("producer-0", 3)
    assert [p.step for p in drain(src)] == [0, 1, 2, 3]
    src.on_weights_applied("producer-0", 1)
    assert src.policy_version == 1
    src.on_dropped(["p00000003"], "stale")  # the step-3 prompt is replaced ...
    assert not src.may_issue()  # ... but only once version 3 is back
    src.on_weights_applied("producer-0", 3)
    assert [p.step for p in drain(src)] == [3]


def test_prompts_validate_on_the_wire(examples):
    src = make(examples)
    p = src.issue()
    back = decode(encode(p))
    assert isinstance(back, Prompt)
    assert (back.id, back.index, back.step, back.task, back.messages, back.info) == (
        p.id,
        p.index,
        p.step,
        p.task,
        p.messages,
        p.info,
    )


def test_bad_arguments(examples):
    with pytest.raises(ValueError):
        PromptSource([], task="reverse_text", prompts_per_step=1, max_async_level=0, max_steps=1)
    for pps, level, steps in ((0, 0, 1), (1, -1, 1), (1, 0, 0)):
        with pytest.raises(ValueError):
            make(examples, pps=pps, level=level, max_steps=steps)


def test_gate_is_the_slowest_producer(examples):
    src = make(examples, pps=1, level=0, max_steps=10, producers=2)
    assert [p.step for p in drain(src)] == [0]
    src.on_weights_applied("producer-0", 2)  # producer-1 has reported nothing: still version 0
    assert src.policy_version == 0 and not src.may_issue()
    src.on_weights_applied("producer-1", 1)  # min(2, 1) = 1: step 1 may go out, not step 2
    assert src.policy_version == 1
    assert [p.step for p in drain(src)] == [1]
    src.on_weights_applied("producer-1", 2)
    assert [p.step for p in drain(src)] == [2]


def test_prompts_carry_the_temperature_of_their_step(examples, tmp_path):
    sampling = load_config(
        None, ["sampling.temp_scheduler={type: linear, start_temperature: 1.0, end_temperature: 0.5}"]
    ).sampling
    schedule = lambda step: temperature_at(sampling, step, 6)
    src = make(
        examples,
        pps=2,
        level=10,
        max_steps=6,
        ledger=Ledger(tmp_path),
        temperature=schedule,
        system_prompt="Reverse it.",
    )
    prompts = drain(src)
    assert [p.temperature for p in prompts] == pytest.approx(
        [1.0, 1.0, 0.9, 0.9, 0.8, 0.8, 0.7, 0.7, 0.6, 0.6, 0.5, 0.5]
    )
    assert all(p.messages[0] == {"role": "system", "content": "Reverse it."} for p in prompts)
    # a restarted source re-issues a prompt with its step's temperature, not the current one
    src.on_trained([p.id for p in prompts[:9]])
    again = make(examples, pps=2, level=10, max_steps=6, ledger=Ledger(tmp_path), temperature=schedule)
    assert [(p.id, p.temperature) for p in drain(again)] == [
        ("p00000009", pytest.approx(0.6)),
        ("p00000010", pytest.approx(0.5)),
        ("p00000011", pytest.approx(0.5)),
    ]
    assert make(examples).issue().temperature == 1.0  # the default


def _eval_rounds(rounds) -> EvalRounds:
    sets = [
        EvalSet("reverse_text", None, load_task_examples("reverse_text", "eval", 2, 1234)),
        EvalSet("other", None, load_task_examples("reverse_text", "eval", 1, 5)),
    ]
    return EvalRounds(rounds, sets, temperature=0.5)


def test_eval_rounds_are_issued_at_their_version_once_and_outside_the_ledger(examples):
    src = make(examples, pps=1, level=0, max_steps=4, eval_rounds=_eval_rounds([0, 2, 4]))
    first = drain(src)  # version 0: the step-0 prompt (training starts first), then round 0 (3 prompts)
    assert [p.id for p in first] == [
        "p00000000",
        "e000000-reverse_text-00000",
        "e000000-reverse_text-00001",
        "e000000-other-00000",
    ]
    assert [(p.eval_round, p.eval_size, p.temperature) for p in first[1:]] == [(0, 3, 0.5)] * 3
    assert not first[0].is_eval and first[0].eval_size == 0
    src.on_weights_applied("producer-0", 1)
    assert [p.id for p in drain(src)] == ["p00000001"]
    src.on_weights_applied("producer-0", 3)  # jumps past round 2: it is issued late rather than lost
    assert [p.id for p in drain(src)] == [
        "e000002-reverse_text-00000",
        "e000002-reverse_text-00001",
        "e000002-other-00000",
        "p00000002",
        "p00000003",
    ]
    src.on_weights_applied("producer-0", 4)  # the last step's prompts are out: only the final round
    final = drain(src)
    assert [p.eval_round for p in final] == [4, 4, 4] and all(is_eval_id(p.id) for p in final)
    src.on_weights_applied("producer-0", 4)
    src.on_weights_applied("producer-0", 5)
    assert drain(src) == []  # every round once
    # eval prompts are not the ledger's: no issue records, and their outcomes are ignored
    assert src.num_issued == 4 and src.next_step == 4
    assert src.on_dropped([first[1].id], "failed: RuntimeError") == 0
    assert src.on_trained([first[2].id]) == 0
    acc = src.ledger.accounting()
    assert acc["issued"] == 4 and acc["num_unknown"] == 0 and sum(acc["outcomes"].values()) == 0


def test_restarted_source_reissues_eval_rounds_without_result_and_never_done_ones(examples, tmp_path):
    src = make(examples, pps=1, level=0, max_steps=4, ledger=Ledger(tmp_path), eval_rounds=_eval_rounds([0, 2, 4]))
    src.on_weights_applied("producer-0", 2)
    assert sum(p.is_eval for p in drain(src)) == 6  # rounds 0 and 2
    src.on_eval_result(0, "reverse_text")
    src.on_eval_result(2, "reverse_text")  # round 2: one task of two reported
    src.on_eval_result(0, "other")  # round 0 done (journaled)
    src.on_eval_result(0, "other")  # a re-published result: no second note
    journal = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [n["round"] for n in journal if n["event"] == "eval_done"] == [0]
    again = make(examples, pps=1, level=0, max_steps=4, ledger=Ledger(tmp_path), eval_rounds=_eval_rounds([0, 2, 4]))
    again.restore_applied([("producer-0", 2)])
    reissued = [p for p in drain(again) if p.is_eval]  # round 2 had no result of "other": all its prompts again
    assert [p.id for p in reissued] == [
        "e000002-reverse_text-00000",
        "e000002-reverse_text-00001",
        "e000002-other-00000",
    ]
    again.on_weights_applied("producer-0", 4)
    assert [p.eval_round for p in drain(again) if p.is_eval] == [4, 4, 4]


def test_a_resumed_source_forgets_eval_rounds_above_the_checkpoint(examples, tmp_path):
    src = make(examples, pps=1, level=0, max_steps=4, ledger=Ledger(tmp_path), eval_rounds=_eval_rounds([0, 2, 4]))
    src.on_weights_applied("producer-0", 2)
    drain(src)
    for r in (0, 2):
        for task in ("reverse_text", "other"):
            src.on_eval_result(r, task)
    src.ledger.note("start", restarts=0, resume=True, checkpoint_step=1)  # as the resumed proc journals it
    again = make(
        examples,
        pps=1,
        level=0,
        max_steps=4,
        ledger=Ledger(tmp_path),
        eval_rounds=_eval_rounds([0, 2, 4]),
        resume_step=1,
    )
    again.on_weights_applied("producer-0", 1)
    assert not any(p.is_eval for p in drain(again))  # round 0 was done; round 2 waits for version 2
    again.on_weights_applied("producer-0", 2)
    assert [p.eval_round for p in drain(again) if p.is_eval] == [2, 2, 2]


def test_reissues_after_a_restart_pass_the_async_gate(examples, tmp_path):
    src = make(examples, pps=2, level=1, max_steps=10, ledger=Ledger(tmp_path))
    for v in range(4):
        src.on_weights_applied("producer-0", v)
        drain(src)
    assert src.next_step == 5  # steps 0..4 issued (version 3, level 1), nothing trained: 10 unresolved
    again = make(examples, pps=2, level=1, max_steps=10, ledger=Ledger(tmp_path))
    again.on_weights_applied("producer-0", 1)  # e.g. a resume at an earlier checkpoint
    assert [p.step for p in drain(again)] == [0, 0, 1, 1, 2, 2]  # steps <= 1 + 1 only
    again.on_weights_applied("producer-0", 3)
    assert [p.step for p in drain(again)] == [3, 3, 4, 4]  # then the rest, and new prompts only after them
    again.on_weights_applied("producer-0", 4)
    assert [(p.id, p.step) for p in drain(again)] == [("p00000010", 5), ("p00000011", 5)]


# ------------------------------------------------------------------------------------------------
# producers that depart, return, or never report
# ------------------------------------------------------------------------------------------------


def test_departed_producer_stops_holding_the_gate_after_dead_after_s(examples):
    clock = Clock()
    src = make(examples, pps=1, level=0, producers=2, dead_after_s=10.0, clock=clock)
    src.on_weights_applied("producer-0", 1)
    src.on_weights_applied("producer-1", 1)
    assert [p.step for p in drain(src)] == [0, 1]
    src.on_weights_applied("producer-0", 2)  # producer-1 died before applying version 2
    clock.t += 10.0
    assert src.policy_version == 1 and not src.may_issue()  # not yet: it may just be slow
    assert src.applied.departed(clock.t) == []
    clock.t += 0.5  # behind for more than dead_after_s, with no further announcement at all
    assert src.applied.departed(clock.t) == ["producer-1"]
    assert src.policy_version == 2
    assert [p.step for p in drain(src)] == [2]
    # it returns (a restart with the same name) and re-applies the current weights: counted again
    src.on_weights_applied("producer-1", 2)
    assert src.applied.departed(clock.t) == []
    src.on_weights_applied("producer-0", 3)
    assert src.policy_version == 2  # the returned producer is the slowest again
    src.on_weights_applied("producer-1", 3)
    assert [p.step for p in drain(src)] == [3]


def test_slow_producer_that_catches_up_is_never_ignored(examples):
    clock = Clock()
    src = make(examples, pps=1, level=0, producers=2, dead_after_s=5.0, clock=clock)
    for version in range(1, 6):
        src.on_weights_applied("producer-0", version)
        clock.t += 4.0  # always behind for 4 s < dead_after_s, over 20 s in all
        assert src.policy_version == version - 1
        src.on_weights_applied("producer-1", version)
        assert src.policy_version == version
        clock.t += 30.0  # a long step: nobody announces, nobody is behind
        assert src.policy_version == version and src.applied.departed(clock.t) == []


def test_removed_producer_at_a_higher_version_never_holds_the_gate_back(examples):
    # producer-1 applied version 5 and was removed; the trainer resumed from its checkpoint at 3
    clock = Clock()
    src = make(examples, pps=1, level=0, producers=2, clock=clock)
    src.on_weights_applied("producer-0", 5)
    src.on_weights_applied("producer-1", 5)
    src.on_weights_applied("producer-0", 3)
    assert src.policy_version == 3  # min(3, 5): the lower, newest announcement counts at once
    clock.t += 9.0
    src.on_weights_applied("producer-0", 4)
    src.on_weights_applied("producer-0", 6)
    assert src.policy_version == 5  # producer-1 differs since the announcement of 3, 9 s ago
    clock.t += 1.5
    assert src.applied.departed(clock.t) == ["producer-1"]
    assert src.policy_version == 6


def test_initial_producer_that_never_reports_stops_holding_the_gate(examples):
    clock = Clock()
    src = make(examples, pps=1, level=0, producers=3, dead_after_s=10.0, clock=clock)
    src.on_weights_applied("producer-0", 2)
    src.on_weights_applied("producer-1", 2)
    clock.t += 10.0
    assert src.policy_version == 0  # waiting for producer-2's first announcement
    clock.t += 0.5
    assert src.policy_version == 2  # it died before announcing: go on with the ones we have
    src.on_weights_applied("producer-2", 1)  # it shows up after all, behind: it gates again
    assert src.policy_version == 1


def test_scaled_up_producer_joins_the_gate_when_it_announces(examples):
    clock = Clock()
    src = make(examples, pps=1, level=0, producers=1, clock=clock)
    src.on_weights_applied("producer-0", 4)
    assert src.policy_version == 4
    src.on_weights_applied("producer-1", 3)  # `busctl scale producers=2`: loaded an older version first
    assert src.policy_version == 3


def test_applied_versions_rejects_bad_arguments():
    for args in ((0, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            AppliedVersions(*args)


# ------------------------------------------------------------------------------------------------
# restart / resume from the ledger journal
# ------------------------------------------------------------------------------------------------


def test_restarted_source_reissues_unresolved_prompts_first_with_same_id_and_content(examples, tmp_path):
    src = make(examples, pps=2, level=1, ledger=Ledger(tmp_path))
    first = drain(src)  # p0..p3, steps 0, 0, 1, 1
    src.on_trained([first[0].id])
    src.on_dropped([first[1].id], "stale")
    repl = drain(src)  # one replacement: p4, for step 0 (live prompts 0, 4 | 2, 3)
    assert [(p.id, p.step) for p in repl] == [("p00000004", 0)]
    # killed here (no close); a new process rebuilds from the journal
    again = make(examples, pps=2, level=1, ledger=Ledger(tmp_path))
    assert again.next_step == src.next_step == 2 and again.num_issued == 5
    reissued = drain(again)  # gated at version 0: only the re-issues may go, ungated
    by_id = {p.id: p for p in first + repl}
    assert [p.id for p in reissued] == ["p00000002", "p00000003", "p00000004"]
    for p in reissued:
        orig = by_id[p.id]
        assert (p.index, p.step, p.task, p.messages, p.info) == (
            orig.index,
            orig.step,
            orig.task,
            orig.messages,
            orig.info,
        )
    assert again.num_reissued == 3 and again.num_issued == 5  # re-issues are not new prompts
    again.on_weights_applied("producer-0", 1)
    new = drain(again)
    assert [(p.id, p.step) for p in new] == [("p00000005", 2), ("p00000006", 2)]
    assert new[0].messages == [{"role": "user", "content": examples[5 % 3]["prompt"]}]


def test_reissue_skips_prompts_resolved_meanwhile(examples, tmp_path):
    src = make(examples, pps=3, level=0, ledger=Ledger(tmp_path))
    drain(src)
    again = make(examples, pps=3, level=0, ledger=Ledger(tmp_path))
    assert list(again.reissue) == ["p00000000", "p00000001", "p00000002"]
    again.on_trained(["p00000001"])  # the original reached its outcome before the copy went out
    assert [p.id for p in drain(again)] == ["p00000000", "p00000002"]
    acc = again.ledger.accounting()
    assert acc["issued"] == 3 and acc["unresolved"] == ["p00000000", "p00000002"]


def test_restart_restores_applied_versions_since_the_run_started(examples, tmp_path):
    clock = Clock()
    led = Ledger(tmp_path)
    led.note("start", restarts=0, resume=False)
    src = make(examples, pps=1, level=0, producers=2, ledger=led, clock=clock)
    src.on_weights_applied("producer-0", 1)
    src.on_weights_applied("producer-1", 1)
    src.on_weights_applied("producer-1", 2)  # producer-0 dies before applying 2
    replayed = Ledger(tmp_path)
    announcements = applied_since_start(replayed.notes)
    assert announcements == [("producer-0", 1), ("producer-1", 2)]
    again = make(examples, pps=1, level=0, producers=2, ledger=replayed, clock=clock)
    again.restore_applied(announcements)
    assert again.policy_version == 1
    clock.t += 10.5
    assert again.policy_version == 2  # producer-0 was behind before the restart and still is
    # a resumed run starts a new producer set: nothing from before its start is restored
    replayed.note("start", restarts=0, resume=True)
    replayed.note("applied", producer="producer-0", version=7)
    assert applied_since_start(Ledger(tmp_path).notes) == [("producer-0", 7)]
