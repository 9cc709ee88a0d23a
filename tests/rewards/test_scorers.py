"""Tests for rewards.scorers: a reward function that raises, hangs, crashes or returns NaN costs
one call (reward 0 for that function on that sample, counted by label), never the scorer. Real child
processes, no mocks; the misbehaving functions live in reward_fns.py and are referenced by import path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import reward_fns
from prometheus_client import REGISTRY

from bus.messages import RolloutGroup
from rewards.scorers import InProcessScorer, IsolatedScorer
from rewards.worker import RewardWorker
from tests.processes import running

TIMEOUT_S = 0.5
SLACK_S = 2.0  # on top of TIMEOUT_S: kill + restart of a child on a loaded 2-core host


def ref(fn: str) -> str:
    return f"{reward_fns.__name__}:{fn}"


def gone_within(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def errors(label: str) -> float:
    return REGISTRY.get_sample_value("rlbus_rewards_errors_total", {"error": label}) or 0.0


def group(texts: list[str]) -> RolloutGroup:
    n = len(texts)
    return RolloutGroup(
        id="grp-iso",
        prompt_index=0,
        step=0,
        task="t",
        info={},
        producer="p-0",
        completion_texts=list(texts),
        finish_reasons=["stop"] * n,
        gen_time_s=0.0,
        prompt_ids=np.arange(2, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        completion_lens=np.ones(n, np.int32),
        sampler_logprobs=np.zeros(n, np.float32),
        version_start=np.zeros(n, np.int64),
        version_end=np.zeros(n, np.int64),
    )


@pytest.fixture
def make_scorer():
    """IsolatedScorer factory; every scorer is closed after the test and must leave no child behind."""
    made: list[IsolatedScorer] = []

    def make(*reward_fns: str, num_procs: int = 1, timeout_s: float = TIMEOUT_S) -> IsolatedScorer:
        made.append(IsolatedScorer(list(reward_fns or [ref("by_text")]), timeout_s=timeout_s, num_procs=num_procs))
        return made[-1]

    yield make
    for scorer in made:
        pids = scorer.pids()
        scorer.close()
        assert not any(running(p) for p in pids)


def test_registry_name_scores_like_in_process(make_scorer):
    texts = ["olleh", "", "oll", " xolleh <|im_end|>"]
    info = {"target": "olleh"}
    [got] = make_scorer("reverse_text", num_procs=2).score(texts, info)
    [in_process] = InProcessScorer(["reverse_text"]).score(texts, info)
    assert got.rewards == in_process.rewards == [1.0, 0.0, 0.75, 10 / 11]
    assert got.errors == [None] * 4


@pytest.mark.parametrize(
    "text, label, replaced",
    [
        ("raise", "ValueError", False),
        ("nan", "non_finite", False),
        ("exit", "crash", True),
        ("segv", "crash", True),
        ("sleep", "timeout", True),
    ],
)
def test_failure_scores_zero_and_scorer_recovers(make_scorer, text, label, replaced):
    scorer = make_scorer()
    [pid] = scorer.pids()
    [got] = scorer.score([text], {})
    assert (got.rewards, got.errors) == ([0.0], [label])
    [new_pid] = scorer.pids()
    assert (new_pid != pid) == replaced and running(new_pid)
    assert not replaced or gone_within([pid], 1.0)  # the hung or dead child is reaped, not left behind
    [got] = scorer.score(["abc", "de"], {})  # the same scorer still works
    assert (got.rewards, got.errors) == ([3.0, 2.0], [None, None])


def test_non_numeric_result_is_an_error_of_its_type(make_scorer):
    [got] = make_scorer(ref("returns_text")).score(["x"], {})
    assert (got.rewards, got.errors) == ([0.0], ["ValueError"])


def test_timeout_costs_about_timeout_s_and_zeroes_only_its_sample(make_scorer):
    timeout_s = 3.0  # long against the kill + restart of a child (2.3 s seen under load with xdist)
    scorer = make_scorer(num_procs=2, timeout_s=timeout_s)
    started = time.monotonic()
    [got] = scorer.score(["sleep", "a", "bb", "ccc"], {})
    elapsed = time.monotonic() - started
    assert got.rewards == [0.0, 1.0, 2.0, 3.0] and got.errors == ["timeout", None, None, None]
    assert timeout_s <= elapsed < timeout_s + SLACK_S + 1.0
    # two hung samples on two children: their deadlines run side by side (one after the other: >= 2 x timeout_s)
    started = time.monotonic()
    assert scorer.score(["sleep", "sleep"], {})[0].errors == ["timeout", "timeout"]
    assert timeout_s <= time.monotonic() - started < 2 * timeout_s


def test_several_functions_in_one_child_named_by_index(make_scorer):
    scorer = make_scorer(ref("by_text"), "reverse_text", ref("length"), num_procs=2)
    texts = ["olleh", "sleep", "raise", "oll"]
    by_text, length = scorer.score(texts, {"target": "olleh"}, [0, 2])  # any subset, in the order asked
    assert (by_text.rewards, by_text.errors) == ([5.0, 0.0, 0.0, 3.0], [None, "timeout", "ValueError", None])
    assert (length.rewards, length.errors) == (
        [5.0, 5.0, 5.0, 3.0],
        [None] * 4,
    )  # the failing calls cost only their term
    [reverse] = scorer.score(texts, {"target": "olleh"}, [1])
    assert reverse.rewards[0] == 1.0 and reverse.errors == [None] * 4
    with pytest.raises(ValueError, match="out of range"):
        scorer.score(texts, {}, [3])


def test_bare_string_is_not_a_list_of_functions():
    with pytest.raises(TypeError, match="list"):
        IsolatedScorer("reverse_text")
    with pytest.raises(TypeError, match="list"):
        InProcessScorer("reverse_text")
    with pytest.raises(ValueError, match="empty"):
        IsolatedScorer([])


def test_worker_counts_every_failure_by_label_and_goes_on():
    labels = ["timeout", "ValueError", "crash", "non_finite"]
    before = {label: errors(label) for label in labels}
    worker = RewardWorker(
        {"t": ((ref("by_text"), 1.0),)}, advantage="drgrpo", eps=1e-6, name="rw", timeout_s=TIMEOUT_S, num_procs=2
    )
    try:
        scored = worker.score(group(["ab", "sleep", "raise", "exit", "nan", "segv", "abcd", "abc"]))
        assert scored.rewards.tolist() == [2.0, 0, 0, 0, 0, 0, 4.0, 3.0]
        assert np.isfinite(scored.advantages).all()
        assert {label: errors(label) - before[label] for label in labels} == {
            "timeout": 1,
            "ValueError": 1,
            "crash": 2,
            "non_finite": 1,
        }
        assert worker.score(group(["a", "bb"])).rewards.tolist() == [1.0, 2.0]
    finally:
        pids = worker.scorer.pids()
        worker.close()
    assert gone_within(pids, 1.0)


def test_child_killed_while_idle_is_replaced_without_blame(make_scorer):
    scorer = make_scorer()
    [pid] = scorer.pids()
    os.kill(pid, signal.SIGKILL)
    assert gone_within([pid], 2.0)
    [got] = scorer.score(["abc"], {})
    assert (got.rewards, got.errors) == ([3.0], [None])
    assert scorer.pids() != [pid]


@pytest.mark.parametrize(
    "reward_fn", ["no_such_reward", ref("no_such_fn"), "no_such_module_xyz:f", ":f", ref("BY_TEXT")]
)
def test_unresolvable_reference_fails_at_start_and_leaves_no_child(reward_fn):
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match=f"reward.*{reward_fn}"):  # names the bad one, after a good one
        IsolatedScorer(["reverse_text", reward_fn], num_procs=2)
    assert {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE} <= before


def test_close_stops_every_child_and_is_idempotent():
    scorer = IsolatedScorer([ref("by_text")], timeout_s=TIMEOUT_S, num_procs=3)
    scorer.score(["sleep", "a"], {})  # one child replaced on the way
    pids = scorer.pids()
    assert len(pids) == 3 and all(running(p) for p in pids)
    scorer.close()
    scorer.close()
    assert not any(running(p) for p in pids)
    assert not set(pids) & {p.pid for p in psutil.Process().children()}


def test_killed_worker_takes_its_hung_children_along():
    # A stand-in reward worker that is SIGKILLed while both its children hang in the reward function:
    # nothing runs its close(), so PR_SET_PDEATHSIG must end them.
    script = (
        "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from rewards.scorers import IsolatedScorer; "
        "s = IsolatedScorer([sys.argv[2]], timeout_s=60, num_procs=2); print(json.dumps(s.pids()), flush=True); "
        "s.score(['sleep', 'sleep'], {})"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(sys.path), ref("by_text")], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = json.loads(worker.stdout.readline())
        time.sleep(0.3)  # both samples handed out
        assert len(pids) == 2 and all(running(p) for p in pids)
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()
    assert gone_within(pids, 3.0)
