"""Failure shares of reward functions (:mod:`telemetry.failure_window`): the window arithmetic on plain
outcomes, then a real :class:`rewards.worker.RewardWorker` with isolated children whose functions raise,
time out and return NaN, each named with its error and first message."""

from __future__ import annotations

import pytest
import reward_fns
from test_worker import rollout

from rewards.worker import RewardWorker
from telemetry.failure_window import FailureWindows

FAIL = ("TypeError", "unsupported operand")


def test_a_function_warns_from_a_quarter_window_stops_once_it_is_full_and_stop_is_final():
    w = FailureWindows(window=10, warn_fraction=0.1, max_fraction=0.5)
    assert w.record("reward", "f", [FAIL]) == "ok"  # 1 call: not judged yet
    assert w.record("reward", "f", [FAIL]) == "warn"  # 2 of 2 (a quarter window): a warning, never a stop
    assert w.record("reward", "f", [FAIL] * 7) == "warn"  # 9 of 9: still no stop before the window is full
    assert w.record("reward", "f", [FAIL]) == "stop"  # 10 of 10 > 0.5
    assert w.record("reward", "f", [None] * 10) == "stop"  # a stopped function stays stopped
    rep = w.report()["f"]
    assert rep == {
        "kind": "reward",
        "calls": 20,
        "errors": 10,
        "share": 0.0,
        "window": 10,
        "error": "TypeError",
        "message": "unsupported operand",
        "level": "stop",
    }


def test_warning_share_holds_until_half_of_it_and_clean_functions_are_not_reported():
    w = FailureWindows(window=10, warn_fraction=0.2, max_fraction=0.5)
    assert w.record("env", "e", [None] * 7 + [FAIL] * 3) == "warn"  # 0.3: above 0.2, not above 0.5
    assert w.record("env", "e", [None] * 8) == "warn"  # 0.2: no longer above it, but above half of it
    assert w.report()["e"]["share"] == 0.2
    assert w.record("env", "e", [None]) == "ok"  # 0.1: recovered
    w.record("reward", "clean", [None] * 50)
    assert set(w.report()) == {"e"}
    assert w.record("reward", "f", [FAIL] * 5 + [None] * 5) == "warn"  # exactly 0.5 is not above the stop share
    with pytest.raises(ValueError):
        FailureWindows(window=10, warn_fraction=0.6, max_fraction=0.5)


def test_reward_worker_reports_each_failing_function_with_its_error_and_first_message():
    w = FailureWindows(window=8, warn_fraction=0.1, max_fraction=0.5)
    fns = reward_fns.__name__
    spec = {"reverse_text": [(f"{fns}:length", 1.0), (f"{fns}:raises", 1.0), (f"{fns}:by_text", 1.0)]}
    worker = RewardWorker(spec, name="rw-0", timeout_s=0.5, num_procs=2, failures=w)
    try:
        worker.score(rollout(["abc", "nan", "sleep", "de"]))
        worker.score(rollout(["fg", "hi", "jk", "lm"]))
    finally:
        worker.close()
    rep = w.report()
    assert set(rep) == {"raises", "by_text"}  # length never failed
    assert rep["raises"]["calls"] == rep["raises"]["errors"] == 8 and rep["raises"]["level"] == "stop"
    assert (rep["raises"]["error"], rep["raises"]["message"]) == ("ValueError", "cannot score 'abc'")
    by_text = rep["by_text"]  # nan then sleep (timeout) on the first group: 2 of 8 calls
    assert (by_text["calls"], by_text["errors"], by_text["share"], by_text["level"]) == (8, 2, 0.25, "warn")
    assert by_text["error"] == "non_finite" and "non-finite" in by_text["message"]


def test_heartbeats_carry_the_report_and_a_malformed_one_is_refused():
    from bus.codec import decode, encode
    from bus.messages import ComponentHeartbeat
    from bus.wire import WireError

    w = FailureWindows(window=8, warn_fraction=0.1, max_fraction=0.5)
    w.record("agent", "pkg.agent:run", [FAIL] * 8)
    beat = ComponentHeartbeat(id="h", name="producer-0", pid=1, state="running", failures=w.report())
    assert decode(encode(beat)).failures == w.report()
    for bad in ({"f": {"kind": "reward"}}, {"f": {**w.report()["pkg.agent:run"], "calls": "8"}}):
        with pytest.raises(WireError, match="inconsistent"):
            decode(encode(ComponentHeartbeat(id="h", name="p", pid=1, state="running", failures=bad)))
