"""``lifecycle.launch_env.LaunchEnv``: the environment a supervisor hands a component, parsed in one place."""

from __future__ import annotations

import pytest

from lifecycle.launch_env import (
    ENV_LATE_JOIN,
    ENV_NAMES,
    ENV_NODE_ADDRESS,
    ENV_RESTARTS,
    ENV_RESUME,
    ENV_SPAWN_ID,
    LaunchEnv,
)


def test_an_empty_environment_is_a_first_start():
    env = LaunchEnv.from_environ({})
    assert env == LaunchEnv(restarts=0, resume=False, late_join=False)
    assert not env.continues and not env.joins_late and env.to_environ() == {}


def test_values_are_read_and_written_back():
    environ = {ENV_RESTARTS: " 3 ", ENV_RESUME: "1", ENV_LATE_JOIN: "1", "PATH": "/bin"}
    env = LaunchEnv.from_environ(environ)
    assert env == LaunchEnv(restarts=3, resume=True, late_join=True)
    assert env.to_environ() == {ENV_RESTARTS: "3", ENV_RESUME: "1", ENV_LATE_JOIN: "1"}
    assert LaunchEnv.from_environ(env.to_environ()) == env
    assert set(env.to_environ()) == set(ENV_NAMES)


def test_empty_and_zero_values_mean_unset():
    env = LaunchEnv.from_environ({ENV_RESTARTS: "", ENV_RESUME: "0", ENV_LATE_JOIN: ""})
    assert env == LaunchEnv()


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({ENV_RESTARTS: "-1"}, "RLBUS_RESTARTS='-1'"),
        ({ENV_RESTARTS: "two"}, "RLBUS_RESTARTS='two'"),
        ({ENV_RESUME: "yes"}, "RLBUS_RESUME='yes'"),
        ({ENV_LATE_JOIN: "2"}, "RLBUS_LATE_JOIN='2'"),
    ],
)
def test_a_bad_value_names_the_variable(environ, named):
    with pytest.raises(ValueError, match=named):
        LaunchEnv.from_environ(environ)


def test_restarted_resumed_or_late_components_join_late():
    assert LaunchEnv(restarts=1).continues and LaunchEnv(restarts=1).joins_late
    assert LaunchEnv(resume=True).continues and LaunchEnv(resume=True).joins_late
    assert not LaunchEnv(late_join=True).continues and LaunchEnv(late_join=True).joins_late


def test_a_negative_or_non_int_restart_count_is_refused():
    with pytest.raises(ValueError, match="restarts"):
        LaunchEnv(restarts=-1)
    with pytest.raises(ValueError, match="restarts"):
        LaunchEnv(restarts=True)


def test_a_launchers_spawn_id_round_trips_and_is_checked():
    env = LaunchEnv.from_environ({ENV_SPAWN_ID: "123456"})
    assert env.spawn_id == 123456 and env.to_environ() == {ENV_SPAWN_ID: "123456"}
    assert not env.continues  # a spawn id says nothing about restarts
    with pytest.raises(ValueError, match=ENV_SPAWN_ID):
        LaunchEnv.from_environ({ENV_SPAWN_ID: "step-7"})


def test_a_node_address_moves_the_metrics_off_loopback():
    assert LaunchEnv.from_environ({}).metrics_host == "127.0.0.1"
    env = LaunchEnv.from_environ({ENV_NODE_ADDRESS: " 10.1.2.3 "})
    assert env.node_address == env.metrics_host == "10.1.2.3"
    assert env.to_environ() == {ENV_NODE_ADDRESS: "10.1.2.3"} and ENV_NODE_ADDRESS not in ENV_NAMES
