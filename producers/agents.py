"""Agent groups in a producer: each of a group's ``n`` samples is one call of the task's agent function
(:mod:`tasks.agent`, in isolated children) against this producer's OpenAI-compatible endpoint (presenting its
``api_key``), recorded as a token-exact episode (:mod:`producers.endpoint_episodes`; episodes
``<request_id>-<j>``, seed ``seed + j``).

The group's prompt is the longest common prefix of the episodes' first prompts; the rest of each leads its
completion as environment tokens. A failed agent call (raised, timed out, crashed, no finite float) keeps its
tokens with reward 0 and ``env_error: <label>``. Tool calls are only seen as the ``<tool_call>`` blocks of the
returned texts, counted under ``tool="other"``.
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
from telemetry.failure_window import FailureWindows


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
    """``ep`` with environment tokens ``head`` first (at ``ep``'s first version, else ``version``)."""
    out = Episode(turns=ep.turns, finish=ep.finish, done=True)
    out.add_env_turn(head, ep.versions[0] if ep.versions else version)
    out.token_ids += ep.token_ids
    out.logprobs += ep.logprobs
    out.versions += ep.versions
    out.model_mask += ep.model_mask
    return out


class AgentRunner:
    """Runs agent groups (import paths ``agents``) on the producer's started endpoint in ``num_procs`` isolated
    children, ``timeout_s`` seconds per agent call (a whole episode)."""

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        agents: list[str],
        *,
        timeout_s: float,
        num_procs: int,
        failures: FailureWindows | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.failures = failures  # each episode's outcome, per agent
        self.agents = list(dict.fromkeys(agents))
        self.calls = IsolatedCalls(
            self.agents, resolver="tasks.agent:resolve_agent_fn", timeout_s=timeout_s, num_procs=num_procs, what="agent"
        )
        self._lock = asyncio.Lock()

    async def run_group(
        self, agent: str, example: dict, prompt_ids: list[int], *, request_id: str, **kwargs: Any
    ) -> tuple[list[int], list[Sample], list[list[bool]], list[float]]:
        """Run ``kwargs["n"]`` episodes of ``agent`` on ``example`` (``prompt_ids``: used if none made a request).

        Returns ``(prompt_ids, samples, model_masks, rewards)`` (masks ``[L_j]``). ValueError: an unknown agent, or
        first prompts sharing no token.
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
                calls = [(k, [self.endpoint.url, i, example, self.endpoint.api_key]) for i in ids]
                results = await asyncio.to_thread(self.calls.run, calls)
            ENV_SECONDS.observe(time.perf_counter() - started)
        finally:
            recorded = [self.endpoint.episodes.close(i) for i in ids]
        assembled = [assemble_episode(turns) for turns in recorded]
        firsts = [p for p, _, _ in assembled if p]
        prompt = common_prefix(firsts) if firsts else list(prompt_ids)
        if not prompt:
            raise ValueError("the agent's episodes start from prompts with no common first token")
        version = self.endpoint.engine.version
        samples, masks, rewards, fulls = [], [], [], []
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
            elif result.error is not None:
                full.fail(result.error, result.message)
            else:
                full.fail("bad_result", f"returned {str(result.value)[:100]}, not a finite number")
            EPISODE_TURNS.observe(full.turns)
            fulls.append(full)
            samples.append(episode_sample(full, version))
            masks.append(full.model_mask)
            rewards.append(full.reward)
        if self.failures is not None:
            self.failures.record("agent", agent, [s.error for s in fulls])
        return prompt, samples, masks, rewards

    def close(self) -> None:
        """Stop the children; idempotent."""
        self.calls.close()
