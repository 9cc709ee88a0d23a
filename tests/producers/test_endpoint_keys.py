"""API keys on the producers' OpenAI-compatible endpoint (producers.endpoint, configs.api_keys): bound beyond
loopback it answers a missing or wrong key with 401 and an OpenAI-style error only (the engine is never reached),
accepts RLBUS_SERVE_API_KEYS', the key file's and its own agents' key (official ``openai`` client), and an agent
runner's children present the producer's key; on loopback it stays open; busctl up refuses a run beyond loopback
with no key for outside clients. A real aiohttp server and no engine: the routes checked here never reach one.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

from configs.api_keys import ENV_KEYS, check_endpoint_keys, is_loopback  # noqa: E402
from producers.endpoint import REQUESTS, UNAUTHORIZED, OpenAIEndpoint  # noqa: E402
from tasks.agent import resolve_agent_fn  # noqa: E402

AGENT = "tests.producers.test_endpoint_keys:models_agent"


def models_agent(client, example: dict) -> float:
    """An agent that lists the endpoint's models: 1.0 when its key was accepted (else it raises)."""
    return float(len(client.models.list().data))


class _Version:
    version = 3  # AgentRunner reads only the engine's version for an episode without turns


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def open_endpoint(loop, tmp_path, monkeypatch):
    """An endpoint bound on 0.0.0.0 (beyond loopback) with one key from the environment and one from a file."""
    monkeypatch.setenv(ENV_KEYS, "tml-outside, tml-second")
    keys_file = tmp_path / "keys"
    keys_file.write_text("# a comment\nfile-key\n")
    endpoint = OpenAIEndpoint(_Version(), None, max_model_len=64, host="0.0.0.0", keys_file=str(keys_file))
    loop(endpoint.start())
    yield endpoint
    loop(endpoint.close())


def _client(endpoint: OpenAIEndpoint, key: str):
    return openai.OpenAI(base_url=endpoint.url, api_key=key, max_retries=0, timeout=30)


def test_beyond_loopback_a_key_is_needed(open_endpoint):
    endpoint = open_endpoint
    assert endpoint.keys == {"tml-outside", "tml-second", "file-key", endpoint.api_key}
    assert endpoint.api_key.startswith("rlbus-run-") and len(endpoint.api_key) > 30
    for key in ("tml-outside", "tml-second", "file-key", endpoint.api_key):  # Authorization: Bearer
        assert [m.id for m in _client(endpoint, key).models.list().data] == ["rlbus-policy"]
    for key in ("wrong", "rlbus", "tml-outsid"):
        with pytest.raises(openai.AuthenticationError) as err:
            _client(endpoint, key).models.list()
        assert err.value.status_code == 401 and err.value.body == UNAUTHORIZED["error"]
    unauthorized = REQUESTS.labels("chat", "unauthorized")._value.get()
    url = endpoint.url.removesuffix("/v1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"X-API-Key": "nope"}, {"Authorization": "Basic tml-outside"}):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED)  # no engine: nothing else ran
    assert REQUESTS.labels("chat", "unauthorized")._value.get() == unauthorized + 3
    r = httpx.get(f"{url}/v1/models", headers={"X-API-Key": "tml-outside"})  # the Tinker SDK's header
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "rlbus-policy"


def test_agents_present_the_producers_key(open_endpoint, loop):
    from producers.agents import AgentRunner  # here: the agent's children import this module

    endpoint = open_endpoint
    call = resolve_agent_fn(AGENT)
    assert call(endpoint.url, "ep-0", {}, endpoint.api_key) == 1.0
    with pytest.raises(openai.AuthenticationError):
        call(endpoint.url, "ep-0", {})  # the loopback default "rlbus" is refused here
    runner = AgentRunner(endpoint, [AGENT], timeout_s=60, num_procs=1)
    try:
        _, _, _, rewards = loop(runner.run_group(AGENT, {}, [1, 2], request_id="g", n=2))
    finally:
        runner.close()
    assert rewards == [1.0, 1.0]  # each isolated child was let in with the producer's key


def test_loopback_stays_open(loop):
    endpoint = OpenAIEndpoint(_Version(), None, max_model_len=64)
    loop(endpoint.start())
    try:
        assert endpoint.keys is None
        assert [m.id for m in _client(endpoint, "anything").models.list().data] == ["rlbus-policy"]
        assert httpx.get(endpoint.url + "/models").status_code == 200
    finally:
        loop(endpoint.close())


def test_beyond_loopback_without_outside_keys_is_refused(tmp_path, monkeypatch, capsys):
    from busctl import cli

    monkeypatch.delenv(ENV_KEYS, raising=False)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and check_endpoint_keys(host, "") == frozenset()
    for host in ("0.0.0.0", "::", "10.0.0.1", "node-3"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match=f"producers.endpoint_host={host} serves .* beyond loopback"):
            check_endpoint_keys(host, "")
    with pytest.raises(ValueError, match="producers.endpoint_api_keys_file .*nowhere"):
        check_endpoint_keys("0.0.0.0", str(tmp_path / "nowhere"))
    assert check_endpoint_keys("0.0.0.0", "", {ENV_KEYS: "k1,k2"}) == {"k1", "k2"}
    args = ["up", "--dry-run", f"run_dir={tmp_path / 'run'}", "producers.endpoint_host=0.0.0.0"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "needs API keys for its clients" in err and ENV_KEYS in err
    assert not (tmp_path / "run").exists()
