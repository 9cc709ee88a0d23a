"""``busctl.components.healing``: the supervisor's healing policy on plain data (no processes, no clock)."""

from __future__ import annotations

import pytest

from busctl.components.healing import (
    ComponentFacts,
    FailRun,
    HealingRules,
    RestartNow,
    ScheduleRestart,
    backoff_s,
    decide,
)
from configs.schema import SupervisorConfig

SUP = SupervisorConfig(restart=True, max_restarts=3, backoff_initial_s=0.5, backoff_max_s=4.0, backoff_reset_s=60.0)


def rules(*, healing: bool = True, sup: SupervisorConfig = SUP) -> HealingRules:
    return HealingRules(healing=healing, supervisor=sup, ready_timeout_s=30.0, dead_after_s=10.0, run_dir="/runs/r")


def facts(name: str = "rewards-0", **kw) -> ComponentFacts:
    role = name.rpartition("-")[0] if name[-1].isdigit() else name
    defaults = dict(state="running", pid=100, ready_at=1000.0, last_beat=1000.0, due=1030.0)
    return ComponentFacts(name=name, role=role, **{**defaults, **kw})


def test_healthy_components_get_no_decision():
    table = [
        facts("hub"),
        facts("rewards-0", last_beat=1009.0),
        facts("trainer", state="starting", ready_at=None, due=1030.0),
        facts("producer-0", state="done"),
    ]
    assert decide(table, 1010.0, rules()) == []


def test_an_exit_schedules_a_restart_after_the_first_backoff():
    [d] = decide([facts(exit_code=1)], 1005.0, rules())
    assert d == ScheduleRestart("rewards-0", "exited with code 1", at=1005.5, delay_s=0.5, consecutive_crashes=1)


def test_a_signal_death_is_named():
    [d] = decide([facts(exit_code=-9)], 1005.0, rules())
    assert d.reason == "was killed by SIGKILL"


def test_silence_past_dead_after_is_a_crash():
    assert decide([facts(last_beat=1000.0)], 1010.0, rules()) == []  # exactly dead_after_s: not yet
    [d] = decide([facts(last_beat=1000.0)], 1010.5, rules())
    assert isinstance(d, ScheduleRestart) and d.reason.startswith("was silent for 10.5 s")


def test_not_ready_in_time_is_a_crash():
    starting = facts("trainer", state="starting", ready_at=None, last_beat=None, due=1030.0)
    assert decide([starting], 1030.0, rules()) == []
    [d] = decide([starting], 1030.1, rules())
    assert d.name == "trainer" and d.reason == "was not ready within 30 s"


def test_backoff_doubles_per_consecutive_crash_and_resets_after_a_long_run():
    [d] = decide([facts(exit_code=1, consecutive_crashes=2, ready_at=1000.0)], 1010.0, rules())
    assert (d.consecutive_crashes, d.delay_s, d.at) == (3, 2.0, 1012.0)
    [d] = decide([facts(exit_code=1, consecutive_crashes=5)], 1010.0, rules())
    assert d.delay_s == 4.0  # capped at backoff_max_s
    [d] = decide([facts(exit_code=1, consecutive_crashes=5, ready_at=1000.0)], 1060.0, rules())
    assert (d.consecutive_crashes, d.delay_s) == (1, 0.5)  # stayed up backoff_reset_s


def test_backoff_formula():
    assert [backoff_s(k, SUP) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="consecutive_crashes"):
        backoff_s(0, SUP)


def test_a_restart_is_due_at_its_time():
    waiting = facts(state="restarting", due=1020.0, exit_code=1)
    assert decide([waiting], 1019.9, rules()) == []
    assert decide([waiting], 1020.0, rules()) == [RestartNow("rewards-0")]


def test_the_restart_budget_fails_the_run():
    [d] = decide([facts(exit_code=1, restarts=2)], 1005.0, rules())
    assert isinstance(d, ScheduleRestart)
    [d] = decide([facts(exit_code=1, restarts=3)], 1005.0, rules())
    assert isinstance(d, FailRun) and "after 3 restarts" in d.message and "supervisor.max_restarts=3" in d.message


def test_the_packer_is_restarted_like_any_component():
    [d] = decide([facts("packer", exit_code=1)], 1005.0, rules())
    assert isinstance(d, ScheduleRestart)


def test_crashes_fail_the_run_at_start_up_or_with_restart_off():
    [d] = decide([facts(exit_code=1)], 1005.0, rules(healing=False))
    assert d == FailRun("rewards-0", "exited with code 1", "rewards-0 exited with code 1")
    off = SUP.model_copy(update={"restart": False})
    [d] = decide([facts(exit_code=1)], 1005.0, rules(sup=off))
    assert isinstance(d, FailRun)


def test_stopping_and_exited_components_are_not_judged():
    table = [facts(state="stopping", exit_code=0, last_beat=0.0), facts("rewards-1", state="exited", exit_code=1)]
    assert decide(table, 5000.0, rules()) == []


def test_decisions_come_in_table_order():
    table = [facts("producer-0", state="restarting", due=0.0), facts("hub", exit_code=1), facts("trainer")]
    assert [type(d) for d in decide(table, 1005.0, rules())] == [RestartNow, ScheduleRestart]
