"""Environment and agent failures reach the producer's failure shares (:mod:`telemetry.failure_window`, carried
to ``busctl up`` by its heartbeats): real :class:`producers.episodes.EpisodeRunner` and
:class:`producers.agents.AgentRunner` over real isolated children, on calls that fail before any model turn (so
no engine is started: the engine is only asked its policy version)."""

from __future__ import annotations

import asyncio
import types

from producers.agents import AgentRunner
from producers.endpoint import OpenAIEndpoint
from producers.episodes import EpisodeRunner
from tasks.env import EnvCalls
from telemetry.failure_window import FailureWindows

ENV = "tests.tasks.misbehaving_envs:ByText"
AGENT = "tests.tasks.misbehaving_envs:agent_raises"
SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0, repetition_penalty=1.0, seed=1)


def test_failed_episodes_of_environments_and_agents_are_counted_with_their_first_message():
    failures = FailureWindows(window=8, warn_fraction=0.1, max_fraction=0.5)
    engine = types.SimpleNamespace(version=3)  # never asked to generate: every episode ends at reset
    envs = EnvCalls([ENV], timeout_s=10.0, num_procs=1)
    runner = EpisodeRunner(engine, None, envs, max_model_len=64, failures=failures)
    endpoint = OpenAIEndpoint(engine, None, max_model_len=64)
    endpoint.url = "http://127.0.0.1:9/v1"  # never reached: the agent fails first
    agents = AgentRunner(endpoint, [AGENT], timeout_s=20.0, num_procs=1, failures=failures)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(2):
            _, _, rewards = loop.run_until_complete(
                runner.run_group(ENV, 2, [1, 2], {"reset": "raise"}, request_id="e", n=4, **SAMPLING)
            )
            assert rewards == [0.0] * 4
        example = {"messages": [], "info": {"id": "row-7"}, "task": "t"}
        _, _, _, rewards = loop.run_until_complete(
            agents.run_group(AGENT, example, [1, 2], request_id="a", n=2, **SAMPLING)
        )
        assert rewards == [0.0, 0.0]
    finally:
        loop.close()
        envs.close()
        agents.close()
    rep = failures.report()
    env = rep[ENV]
    assert (env["kind"], env["calls"], env["errors"], env["level"]) == ("env", 8, 8, "stop")
    assert (env["error"], env["message"]) == ("RuntimeError", "cannot reset")
    agent = rep[AGENT]
    assert (agent["kind"], agent["calls"], agent["errors"]) == ("agent", 2, 2)
    assert agent["level"] == "warn"  # a quarter window is enough to warn, not to stop
    assert (agent["error"], agent["message"]) == ("ConnectionError", "no route to the tool server for row-7")
