"""Agent groups in a producer: each of a group's ``n`` samples is one call of the task's agent
function (:mod:`tasks.agent`) against this producer's OpenAI-compatible endpoint
(:mod:`producers.endpoint`), recorded and assembled into a token-exact episode
(:mod:`producers.endpoint_episodes`).

Per group: open ``n`` episodes ``<request_id>-<j>`` on the endpoint with the run's sampling
settings (seed ``seed + j``), call the agent function for each in the isolated children (at most
``num_procs`` at a time; groups take turns), close the episodes and assemble them. The group's
prompt is the longest common prefix of the episodes' first prompts (the agent renders its own
first messages; usually they are the task's prompt); the rest of an episode's first prompt leads
its completion as environment tokens. An episode whose agent call failed (raised, timed out,
crashed, returned no finite float) keeps its recorded tokens with reward 0 and finish reason
``env_error: <label>`` (``rlbus_producer_env_errors_total{error}``); a rebased one keeps the turns
up to the one that did not extend the trajectory.

Tool calls: the agent runs its own tools, so only the ``<tool_call>`` blocks of the assistant
texts the endpoint returned are counted (:func:`producers.turn_metrics.text_tool_calls`), under
``tool="other"`` (an agent task declares no tool schemas) and, unreadable ones, ``parse_error``;
``rlbus_producer_episode_tool_calls`` observes only episodes with at least one call.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from producers.endpoint import OpenAIEndpoint
from producers.endpoint_episodes import assemble_episode
from producers.rollout_sample import Sample
from producers.episodes import ENV_SECONDS, EPISODE_TURNS, Episode, episode_sample
from producers.turn_metrics import EPISODE_TOOL_CALLS, count_tool_calls, text_tool_calls
from tasks.isolated_calls import IsolatedCalls


def common_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest common prefix of ``seqs`` (``[]`` for none)."""
    if not seqs:
        return []
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return list(first[:i])
    return list(first[:n])


def with_head(ep: Episode, head: list[int], version: int) -> Episode:
    """``ep`` with environment tokens ``head`` before its first token (version: ``ep``'s first
    token's, else ``version``)."""
    out = Episode(turns=ep.turns, finish=ep.finish, done=True)
    out.add_env_turn(head, ep.versions[0] if ep.versions else version)
    out.token_ids += ep.token_ids
    out.logprobs += ep.logprobs
    out.versions += ep.versions
    out.model_mask += ep.model_mask
    return out


class AgentRunner:
    """Runs agent groups: the producer's endpoint and a pool of isolated children.

    Args:
        endpoint: the producer's started :class:`producers.endpoint.OpenAIEndpoint`.
        agents: agent function import paths (``task.agent`` of the run's tasks).
        timeout_s: most seconds one agent call (a whole episode) may take.
        num_procs: child processes; episodes run this many at a time.
    """

    def __init__(self, endpoint: OpenAIEndpoint, agents: list[str], *, timeout_s: float, num_procs: int) -> None:
        self.endpoint = endpoint
        self.agents = list(dict.fromkeys(agents))
        self.calls = IsolatedCalls(
            self.agents, resolver="tasks.agent:resolve_agent_fn", timeout_s=timeout_s, num_procs=num_procs, what="agent"
        )
        self._lock = asyncio.Lock()

    async def run_group(
        self, agent: str, example: dict, prompt_ids: list[int], *, request_id: str, **kwargs: Any
    ) -> tuple[list[int], list[Sample], list[list[bool]], list[float]]:
        """Run ``kwargs["n"]`` episodes of ``agent`` on ``example`` (``kwargs``:
        :func:`producers.sampling.request_kwargs`; ``prompt_ids``: the group's prompt when no
        episode made a request).

        Returns:
            ``(prompt_ids, samples, model_masks, rewards)``: the group's prompt, one sample per
            episode (completion = environment and model tokens), its ``[L_j]`` model mask, its reward.

        Raises:
            ValueError: ``agent`` is not one of this runner's, or the episodes' first prompts share
                no token.
        """
        if agent not in self.agents:
            raise ValueError(f"unknown agent {agent!r}; known: {self.agents}")
        n, seed = kwargs.pop("n"), kwargs.pop("seed", None)
        ids = [f"{request_id}-{j}" for j in range(n)]
        for j, episode_id in enumerate(ids):
            self.endpoint.episodes.open(episode_id, {**kwargs, "seed": None if seed is None else seed + j})
        k = self.agents.index(agent)
        try:
            async with self._lock:
                started = time.perf_counter()
                results = await asyncio.to_thread(self.calls.run, [(k, [self.endpoint.url, i, example]) for i in ids])
            ENV_SECONDS.observe(time.perf_counter() - started)
        finally:
            recorded = [self.endpoint.episodes.close(i) for i in ids]
        assembled = [assemble_episode(turns) for turns in recorded]
        firsts = [p for p, _, _ in assembled if p]
        prompt = common_prefix(firsts) if firsts else list(prompt_ids)
        if not prompt:
            raise ValueError("the agent's episodes start from prompts with no common first token")
        version = self.endpoint.engine.version
        samples, masks, rewards = [], [], []
        for turns in recorded:
            calls = sum(count_tool_calls(text_tool_calls(t.text), frozenset()) for t in turns)
            if calls:
                EPISODE_TOOL_CALLS.observe(calls)
        for (first, ep, _), result in zip(assembled, results):
            full = with_head(ep, first[len(prompt) :], version)
            ok = (
                result.error is None
                and isinstance(result.value, (int, float))
                and not isinstance(result.value, bool)
                and math.isfinite(result.value)
            )
            if ok:
                full.reward = float(result.value)
            else:
                full.fail(result.error or "bad_result")
            EPISODE_TURNS.observe(full.turns)
            samples.append(episode_sample(full, version))
            masks.append(full.model_mask)
            rewards.append(full.reward)
        return prompt, samples, masks, rewards

    def close(self) -> None:
        """Stop the children; idempotent."""
        self.calls.close()
