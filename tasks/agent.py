"""Agent tasks: ``task.agent: "package.module:function"`` names ``fn(client: openai.OpenAI,
example) -> float``, run once per sample in an isolated child against the producer's
OpenAI-compatible endpoint (:mod:`producers.agents`); it returns the episode's reward.

``example`` is ``{"messages": the prompt's messages, "info": the row's info, "task": name}``. The
client's header ``X-Rlbus-Episode`` records every request into that sample's episode
(:mod:`producers.endpoint_episodes`). ``openai`` is imported in the children only.
"""

from __future__ import annotations

from typing import Any, Callable

from tasks.import_path import import_callable

EPISODE_HEADER = "X-Rlbus-Episode"
CLIENT_TIMEOUT_S = 600.0  # per HTTP request; the call's own timeout (task.agent_timeout_s) bounds the episode


def resolve_agent_fn(ref: str) -> Callable[..., Any]:
    """The children's resolver: the agent at ``ref`` as ``(base_url, episode_id, example, api_key) -> reward``,
    called with an ``openai.OpenAI`` client for that endpoint, episode and key (the producer's, needed beyond
    loopback). ValueError as :func:`tasks.import_path.import_callable`."""
    fn = import_callable(ref, "agent")

    def call(base_url: str, episode_id: str, example: dict, api_key: str = "rlbus") -> Any:
        import openai

        client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key,
            default_headers={EPISODE_HEADER: episode_id},
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        try:
            return fn(client, example)
        finally:
            client.close()

    return call
