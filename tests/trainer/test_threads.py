"""trainer/parallel/threads.py: the trainer's thread count follows what the producers may still sample."""

from __future__ import annotations

import pytest
import torch

from trainer.parallel.threads import ThreadPlan


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_idle_threads_only_once_every_step_ahead_is_complete():
    plan = ThreadPlan(sampling=1, idle=2, lookahead=2, max_steps=10)
    complete = {4}
    assert plan.choose(3, complete.__contains__) == 1  # step 5 may still be sampled
    complete.add(5)
    assert plan.choose(3, complete.__contains__) == 2
    assert plan.choose(5, complete.__contains__) == 1  # steps 6, 7 missing


def test_steps_past_the_end_are_never_sampled_and_async_zero_is_always_idle():
    assert ThreadPlan(1, 2, lookahead=2, max_steps=10).choose(9, lambda s: False) == 2
    assert ThreadPlan(1, 2, lookahead=2, max_steps=10).choose(8, lambda s: s == 9) == 2
    assert ThreadPlan(1, 2, lookahead=0, max_steps=10).choose(0, lambda s: False) == 2


def test_apply_sets_torch_threads_and_counts_idle_micro_batches(restore_threads):
    plan = ThreadPlan(sampling=1, idle=2, lookahead=1, max_steps=10)
    assert plan.apply(0, lambda s: False) == 1 and torch.get_num_threads() == 1
    assert plan.apply(0, lambda s: True) == 2 and torch.get_num_threads() == 2
    plan.apply(1, lambda s: True)
    assert plan.take_idle_count() == 2 and plan.take_idle_count() == 0


@pytest.mark.parametrize("args", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, -1, 1), (1, 1, 1, 0)])
def test_bad_plans_are_refused(args):
    with pytest.raises(ValueError, match="need sampling"):
        ThreadPlan(*args)
