"""``busctl down --finish`` at the prompt source (prompts.source.PromptSource.finish): the run ends after
the steps whose prompts are issued, replacements for those steps still go out, the final eval round
moves there, and a restarted source keeps the decision while a resumed one goes on to max_steps. The
whole path (busctl -> supervisor -> prompt source -> trainer, exit 0) runs in tests/e2e/test_faults.py."""

from __future__ import annotations

from prompts.accounting import Ledger
from tests.prompts.test_prompt_source import _eval_rounds, drain, examples, make  # noqa: F401


def test_finish_ends_after_the_issued_steps_and_still_replaces_their_drops(examples, tmp_path):
    src = make(examples, pps=2, level=1, max_steps=50, ledger=Ledger(tmp_path), eval_rounds=_eval_rounds([0, 5, 50]))
    src.on_weights_applied("producer-0", 2)
    issued = [p for p in drain(src) if not p.is_eval]
    assert [p.step for p in issued] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert src.on_dropped([issued[-1].id], "filtered: equal_rewards") == 1  # step 3 is one short now
    assert src.finish() == 4  # ceil(7 / 2): step 3's prompts are issued (one of them owed again)
    assert src.finish() == 4  # a repeated request (PUB/SUB re-sends) gets the same answer
    src.on_weights_applied("producer-0", 9)
    after = drain(src)
    assert [p.step for p in after if not p.is_eval] == [3]  # the replacement only: no step 4 or later
    assert sorted({p.eval_round for p in after if p.is_eval}) == [4]  # round 5 and 50 gone, 4 is the final one
    assert src.eval_rounds.rounds == [0, 4]


def test_finish_before_any_step_ends_after_one(examples):
    src = make(examples, pps=2, level=0, max_steps=10)
    assert src.finish() == 1
    assert [p.step for p in drain(src)] == [0, 0]
    src.on_weights_applied("producer-0", 1)
    assert drain(src) == []


def test_a_restarted_source_keeps_the_final_step_and_a_resumed_one_goes_on(examples, tmp_path):
    src = make(examples, pps=1, level=0, max_steps=10, ledger=Ledger(tmp_path))
    src.on_weights_applied("producer-0", 1)
    drain(src)  # steps 0 and 1
    assert src.finish() == 2
    restarted = make(examples, pps=1, level=0, max_steps=10, ledger=Ledger(tmp_path))
    restarted.restore_applied([("producer-0", 5)])
    assert restarted.max_steps == 2 and restarted.finish() == 2
    assert [p.step for p in drain(restarted)] == [0, 1]  # the unresolved ones again, nothing new
    resumed = make(examples, pps=1, level=0, max_steps=10, ledger=Ledger(tmp_path), resume_step=0)
    assert resumed.max_steps == 10
