"""Tests for producers.prompt_source.PromptSource (the socket-free logic): gating by the trainer's
version and the async level, replacements for dropped groups, the end of the run, ids and cycling."""

from __future__ import annotations

import pytest

from bus.messages import Prompt, decode, encode
from producers.prompt_source import PromptSource
from producers.tasks import load_task_examples


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


def make(examples, *, pps=2, level=1, max_steps=100) -> PromptSource:
    return PromptSource(examples, task="reverse_text", prompts_per_step=pps, max_async_level=level, max_steps=max_steps)


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


def test_async_level_zero_is_synchronous(examples):
    src = make(examples, pps=3, level=0)
    assert [p.step for p in drain(src)] == [0, 0, 0]
    src.on_weights_applied("producer-0", 1)
    assert [p.step for p in drain(src)] == [1, 1, 1]


def test_dropped_groups_are_replaced_for_the_same_step(examples):
    src = make(examples, pps=2, level=1)
    drain(src)  # 4 prompts: steps 0, 0, 1, 1
    src.on_dropped(1)  # (4 - 1) // 2 = 1: one replacement for step 1
    repl = drain(src)
    assert [p.step for p in repl] == [1]
    assert repl[0].index == 4 and repl[0].id == "p00000004"
    src.on_dropped(3)  # counted = 5 - 4 = 1: step 0 needs one more, step 1 two
    assert [p.step for p in drain(src)] == [0, 1, 1]
    assert not src.may_issue()


def test_nothing_issued_for_step_at_or_beyond_max_steps(examples):
    src = make(examples, pps=2, level=10, max_steps=2)
    prompts = drain(src)  # steps 0 and 1 only, whatever the async level
    assert [p.step for p in prompts] == [0, 0, 1, 1]
    src.on_weights_applied("producer-0", 50)
    assert not src.may_issue()
    src.on_dropped(1)  # a dropped group of the last step is still replaced
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


def test_older_versions_are_ignored(examples):
    src = make(examples, pps=1, level=0)
    src.on_weights_applied("producer-0", 3)
    src.on_weights_applied("producer-0", 1)
    assert src.policy_version == 3
    assert [p.step for p in drain(src)] == [0, 1, 2, 3]


def test_prompts_validate_on_the_wire(examples):
    src = make(examples)
    p = src.issue()
    back = decode(encode(p))
    assert isinstance(back, Prompt)
    assert (back.id, back.index, back.step, back.task, back.messages, back.info) == (
        p.id, p.index, p.step, p.task, p.messages, p.info)


def test_bad_arguments(examples):
    with pytest.raises(ValueError):
        PromptSource([], task="reverse_text", prompts_per_step=1, max_async_level=0, max_steps=1)
    for pps, level, steps in ((0, 0, 1), (1, -1, 1), (1, 0, 0)):
        with pytest.raises(ValueError):
            make(examples, pps=pps, level=level, max_steps=steps)


def test_gate_is_the_slowest_producer(examples):
    src = PromptSource(examples, task="reverse_text", prompts_per_step=1, max_async_level=0, max_steps=10, num_producers=2)
    assert [p.step for p in drain(src)] == [0]
    src.on_weights_applied("producer-0", 2)  # producer-1 has reported nothing: still version 0
    assert src.policy_version == 0 and not src.may_issue()
    src.on_weights_applied("producer-1", 1)  # min(2, 1) = 1: step 1 may go out, not step 2
    assert src.policy_version == 1
    assert [p.step for p in drain(src)] == [1]
    src.on_weights_applied("producer-1", 2)
    assert [p.step for p in drain(src)] == [2]
