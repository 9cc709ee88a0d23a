"""Tests for tasks.env and tasks.isolated_calls: environment calls run in real child processes; one that
hangs, crashes, raises or returns a malformed result costs that call (an error label), never the
pool, and the other calls of the same round keep their results. Also the reverse_turns task's
environment and splits."""

from __future__ import annotations

import misbehaving_envs
import pytest

from tasks.env import MAX_TOOL_RECORDS, EnvCalls, env_refs
from tasks.isolated_calls import IsolatedCalls
from tasks.registry import get_task, load_task_examples
from tasks.reverse_turns import ReverseTurnsEnv

ENV = f"{misbehaving_envs.__name__}:ByText"


@pytest.fixture
def envs():
    pool = EnvCalls([ENV], timeout_s=1.0, num_procs=2)
    yield pool
    pool.close()


def test_a_good_episode_runs_to_done_and_scores(envs):
    (state,) = [r.value for r in envs.call(ENV, "reset", [[{"turns": 2}]])]
    (first,) = envs.call(ENV, "step", [[state, "hello"]])
    messages, done, state = first.value
    assert first.error is None and messages == [{"role": "user", "content": "more 1"}] and not done
    (second,) = envs.call(ENV, "step", [[state, "again"]])
    assert second.value[1] is True and second.value[0] == []
    assert envs.call(ENV, "reward", [[second.value[2]]])[0].value == 2.0


def test_hang_crash_raise_and_bad_results_are_labelled_and_the_rest_survive(envs):
    state = envs.call(ENV, "reset", [[{"turns": 3}]])[0].value
    pids = envs.pids()
    texts = ["hang", "ok", "crash", "raise", "bad", "fine"]
    results = envs.call(ENV, "step", [[state, t] for t in texts])
    assert [r.error for r in results] == ["timeout", None, "crash", "KeyError", "bad_result", None]
    assert results[1].value[0] == [{"role": "user", "content": "more 1"}] and results[5].value[2]["seen"] == 1
    assert len(envs.pids()) == 2 and set(envs.pids()) != set(pids)  # the hung and the crashed child were replaced
    assert envs.call(ENV, "reward", [[results[1].value[2]]])[0].value == 1.0  # the pool still works


def test_step_statistics_are_validated_and_a_malformed_one_is_flagged_not_fatal(envs):
    state = envs.call(ENV, "reset", [[{"turns": 3}]])[0].value
    good = '{"tool_calls": [{"name": "calc", "error": null}, {"name": null, "error": "parse_error"}]}'
    malformed = [
        '"x"',
        '{"tool_calls": "x"}',
        '{"tool_calls": [{"name": 3}]}',
        '{"tool_calls": [{"error": "oops"}]}',
        '{"tool_calls": [{"name": "a", "why": 1}]}',
        '{"tool_calls": [{"name": "%s"}]}' % ("a" * 200),
        '{"tool_calls": [%s]}' % ", ".join(['{"name": "a"}'] * (MAX_TOOL_RECORDS + 1)),
    ]
    texts = ["plain", "stats:" + good, "stats:{}", *("stats:" + m for m in malformed), "stats5:{}"]
    results = envs.call(ENV, "step", [[state, t] for t in texts])
    assert [(r.error, r.tool_calls, r.bad_stats) for r in results[:3]] == [
        (None, (), False),
        (None, (("calc", None), (None, "parse_error")), False),
        (None, (), False),
    ]
    for r in results[3:-1]:  # the step stands; its statistics are dropped and flagged
        assert (r.error, r.tool_calls, r.bad_stats) == (None, (), True) and r.value[2]["seen"] == 1
    assert results[-1].error == "bad_result"  # five elements: not a step result


def test_reset_errors_are_labelled(envs):
    results = envs.call(ENV, "reset", [[{"reset": "raise"}], [{}]])
    assert results[0].error == "RuntimeError" and results[1].value == {"turns": 2, "seen": 0}


def test_unknown_environment_or_function_is_refused(envs):
    with pytest.raises(ValueError, match="unknown environment"):
        envs.call("nope:Env", "step", [[{}, "x"]])
    with pytest.raises(ValueError, match="unknown environment"):
        envs.call(ENV, "render", [[{}]])


def test_an_environment_that_does_not_resolve_fails_at_start():
    with pytest.raises(ValueError, match="cannot be loaded"):
        EnvCalls([f"{misbehaving_envs.__name__}:Missing"], num_procs=1)
    with pytest.raises(ValueError, match="package.module:Object"):
        env_refs("no_colon")
    with pytest.raises(ValueError, match="out of range"):
        with IsolatedCalls(env_refs(ENV), resolver="tasks.env:resolve_env_fn", num_procs=1) as calls:
            calls.run([(3, [])])


def test_reverse_turns_environment_scores_each_turn():
    state = ReverseTurnsEnv.reset({"words": ["abcde", "fghij"]})
    messages, done, state = ReverseTurnsEnv.step(state, "edcba")
    assert messages == [{"role": "user", "content": "fghij"}] and not done
    assert ReverseTurnsEnv.reward(state) == 0.5  # the second string not reached yet scores 0
    messages, done, state = ReverseTurnsEnv.step(state, "xxxxx<|im_end|>")
    assert messages == [] and done and ReverseTurnsEnv.reward(state) == 0.5


def test_reverse_turns_task_is_multi_turn_with_disjoint_splits():
    task = get_task("reverse_turns")
    assert task.env == "tasks.reverse_turns:ReverseTurnsEnv" and task.max_turns == 2 and task.rewards == ()
    train = load_task_examples(task, "train", 200, 0)
    evals = load_task_examples(task, "eval", 50, 0)
    assert not {tuple(e["info"]["words"]) for e in train} & {tuple(e["info"]["words"]) for e in evals}
    assert all(e["prompt"] == e["info"]["words"][0] and len(e["info"]["words"]) == 2 for e in train)
