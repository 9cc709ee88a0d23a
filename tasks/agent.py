"""Agent tasks: a user function written against the official ``openai`` client, run isolated per
episode with a client pointed at the producer's OpenAI-compatible endpoint.

``task.agent: "package.module:function"`` names ``fn(client: openai.OpenAI, example: dict) ->
float``: it talks to the policy through ``client`` (``client.chat.completions.create(...)``,
``client.completions.create(...)``, as often as it likes) and returns the episode's reward (a
finite float). ``example`` is ``{"messages": the prompt's messages, "info": the dataset row's
info, "task": the task name}``. The producer (:mod:`producers.agents`) calls it once per sample
in an isolated child (:class:`tasks.isolated_calls.IsolatedCalls`: a call that raises, runs past its
timeout or crashes its child ends that episode with reward 0, counted; the producer lives on),
with the client's ``base_url`` at the endpoint and the header ``X-Rlbus-Episode`` preset
(``default_headers``), so every request of the call is recorded into that sample's episode
(:mod:`producers.endpoint_episodes`).

The function is named, never pickled: :func:`resolve_agent_fn` resolves it in each child and wraps
it as ``(base_url, episode_id, example) -> float`` (JSON arguments). ``openai`` is imported in the
children only.
"""

from __future__ import annotations

from typing import Any, Callable

from tasks.import_path import import_callable

EPISODE_HEADER = "X-Rlbus-Episode"
CLIENT_TIMEOUT_S = 600.0  # per HTTP request; the call's own timeout (task.agent_timeout_s) bounds the episode


def resolve_agent_fn(ref: str) -> Callable[[str, str, dict], Any]:
    """The agent function at ``ref`` as ``(base_url, episode_id, example) -> reward``: builds an
    ``openai.OpenAI(base_url=base_url, api_key="rlbus", default_headers={EPISODE_HEADER:
    episode_id}, max_retries=0)`` and calls the function with it; the isolated children's resolver.

    Raises:
        ValueError: as :func:`tasks.import_path.import_callable`.
    """
    fn = import_callable(ref, "agent")

    def call(base_url: str, episode_id: str, example: dict) -> Any:
        import openai

        client = openai.OpenAI(
            base_url=base_url,
            api_key="rlbus",
            default_headers={EPISODE_HEADER: episode_id},
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        try:
            return fn(client, example)
        finally:
            client.close()

    return call
