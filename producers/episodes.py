"""Multi-turn episodes in a producer: model turns sampled by vLLM, environment turns rendered by the chat
template, one token-exact trajectory per sample (docs/ARCHITECTURE.md, "Multi-turn episodes").

Each of a group's ``n`` samples is an episode: ``reset(info)``, then model turns (``n=1``, seed ``seed + j``, from
the token ids so far, never re-tokenized; loss mask True) alternating with ``step(state, text)`` whose messages are
rendered as a token suffix (:func:`env_turn_ids`; logprob 0, mask False, the last model token's version) until
``done``, ``max_turns`` or ``max_model_len`` (``"length"``); then ``reward(state)``. A model turn cut by
``max_tokens`` gets the end-of-turn token prepended to the environment suffix. A failing environment call ends
only its episode (reward 0, ``"env_error: <label>"``, counted). :class:`Episode` takes turns from any source
(the OpenAI endpoint too) and :func:`episode_sample` makes it the group's sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from prometheus_client import Counter, Histogram

from producers.rollout_sample import Sample
from producers.turn_metrics import BAD_STATS, EPISODE_TOOL_CALLS, count_tool_calls, preinit_tools, schema_names
from tasks.env import ENV_ERRORS, EnvCalls
from telemetry.failure_window import FailureWindows

EPISODE_TURNS = Histogram(
    "rlbus_producer_episode_turns", "Model turns per multi-turn episode", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32)
)
ENV_SECONDS = Histogram(
    "rlbus_producer_env_seconds",
    "Time of one round of environment calls (reset, step or reward of a group's episodes), seconds",
)
ENV_ERRORS_TOTAL = Counter(
    "rlbus_producer_env_errors_total",
    "Environment calls that failed (episode ended, reward 0), by error: timeout, crash, "
    "bad_result or the exception type",
    ["error"],
)
for _error in ENV_ERRORS:  # exception type names appear when raised
    ENV_ERRORS_TOTAL.labels(_error)

_MODEL_MARKER = "rlbus-model-turn-marker"


def env_turn_ids(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of environment ``messages`` as the chat template renders them after an assistant turn, through
    the next generation prompt: the rendering with them minus the one without, cut after the assistant's end of
    turn. ``tools``: the task's schemas, as the prompt was rendered. ValueError: the template renders the earlier
    turns differently once ``messages`` follow (not token-exact)."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MODEL_MARKER}]
    before = tokenizer.apply_chat_template(base, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(
        base + list(messages), tools=tools, tokenize=False, add_generation_prompt=True
    )
    cut = before.index(_MODEL_MARKER) + len(_MODEL_MARKER)
    eos = tokenizer.eos_token or ""
    if eos and before[cut:].startswith(eos):
        cut += len(eos)
    if after[:cut] != before[:cut]:
        raise ValueError(
            "the chat template renders earlier turns differently once environment turns follow; "
            "environment tokens cannot be appended token-exactly"
        )
    return tokenizer.encode(after[cut:], add_special_tokens=False)


@dataclasses.dataclass
class Episode:
    """One sample's trajectory so far: per completion token ``token_ids``, ``logprobs``, ``versions`` and
    ``model_mask``; the env ``state``; ``finish``: the last model turn's reason or ``"env_error: <label>"``."""

    state: dict | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[bool] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    finish: str = "stop"
    done: bool = False
    reward: float = 0.0
    error: tuple[str, str] | None = None  # (label, message) of the call that ended it

    def add_model_turn(self, sample: Sample, default_version: int) -> None:
        """Append one model turn (versions: ``sample.token_versions``, else ``default_version``)."""
        versions = list(sample.token_versions) or [default_version] * len(sample.token_ids)
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.versions += versions
        self.model_mask += [True] * len(sample.token_ids)
        self.turns += 1
        self.finish = sample.finish_reason

    def add_env_turn(self, ids: list[int], version: int) -> None:
        """Append environment tokens: logprob 0, not model tokens, the turn's ``version``."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.model_mask += [False] * len(ids)

    def fail(self, error: str, message: str = "") -> None:
        """End the episode with reward 0 and reason ``env_error: <error>`` (counted)."""
        ENV_ERRORS_TOTAL.labels(error).inc()
        self.done, self.state, self.reward, self.finish = True, None, 0.0, f"env_error: {error}"
        self.error = (error, message or error)


def episode_sample(ep: Episode, version: int) -> Sample:
    """The episode as one engine :class:`Sample` (``version``: for an episode without tokens)."""
    versions = ep.versions or [version]
    return Sample(
        list(ep.token_ids), list(ep.logprobs), "", ep.finish, min(versions), max(versions), (), tuple(ep.versions)
    )


class EpisodeRunner:
    """Runs multi-turn groups on a producer's engine, tokenizer and isolated environments (``envs``, one call
    at a time). ``tools``: the run's tool schemas, whose metric labels are created at 0 now."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        envs: EnvCalls,
        *,
        max_model_len: int,
        tools: list[dict] | None = None,
        failures: FailureWindows | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.envs, self.max_model_len = engine, tokenizer, envs, max_model_len
        self.failures = failures  # each episode's outcome, per environment
        preinit_tools(schema_names(tools))
        self._lock = asyncio.Lock()

    async def _env(self, env: str, fn: str, args: list[list]) -> list:
        async with self._lock:
            started = time.perf_counter()
            out = await asyncio.to_thread(self.envs.call, env, fn, args)
        ENV_SECONDS.observe(time.perf_counter() - started)
        return out

    async def run_group(
        self,
        env: str,
        max_turns: int,
        prompt_ids: list[int],
        info: dict,
        *,
        request_id: str,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> tuple[list[Sample], list[list[bool]], list[float]]:
        """Run ``kwargs["n"]`` episodes of ``env``; ``kwargs``: :func:`producers.sampling.request_kwargs`.

        Returns ``(samples, model_masks, rewards)``: per episode a :class:`Sample` (model and env tokens
        interleaved), its ``[L_j]`` model-token mask and reward. Raises the engine's or :func:`env_turn_ids`'s
        RuntimeError/ValueError; environment failures never raise.
        """
        n, seed, max_tokens = kwargs.pop("n"), kwargs.pop("seed"), kwargs.pop("max_tokens")
        known = schema_names(tools)
        episodes = [Episode() for _ in range(n)]
        for ep, result in zip(episodes, await self._env(env, "reset", [[info]] * n)):
            if result.error is not None:
                ep.fail(result.error, result.message)
            else:
                ep.state = result.value
        for turn in range(max_turns):
            active = [(j, ep) for j, ep in enumerate(episodes) if not ep.done]
            room = {j: min(max_tokens, self.max_model_len - len(prompt_ids) - len(ep.token_ids)) for j, ep in active}
            for j, ep in active:
                if room[j] < 1:
                    ep.done, ep.finish = True, "length"
            active = [(j, ep) for j, ep in active if not ep.done]
            if not active:
                break
            version = self.engine.version
            outs = await asyncio.gather(
                *(
                    self.engine.generate_group(
                        prompt_ids + ep.token_ids,
                        n=1,
                        max_tokens=room[j],
                        seed=None if seed is None else seed + j,
                        request_id=f"{request_id}-{j}-t{turn}",
                        detokenize=False,
                        **kwargs,
                    )
                    for j, ep in active
                )
            )
            texts = []
            for (j, ep), (sample,) in zip(active, outs):
                ep.add_model_turn(sample, version)
                texts.append(self.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
            results = await self._env(env, "step", [[ep.state, text] for (_, ep), text in zip(active, texts)])
            for (j, ep), result in zip(active, results):
                if result.error is not None:
                    ep.fail(result.error, result.message)
                    continue
                if result.bad_stats:
                    BAD_STATS.inc()
                ep.tool_calls += count_tool_calls(result.tool_calls, known)
                messages, done, ep.state = result.value
                if done or turn + 1 >= max_turns:
                    ep.done = True
                    continue
                ids = env_turn_ids(self.tokenizer, messages, tools)
                eos = self.tokenizer.eos_token_id
                if eos is not None and (not ep.token_ids or ep.token_ids[-1] != eos):
                    ids = [eos, *ids]  # a turn cut by max_tokens: close it as the template would
                if len(prompt_ids) + len(ep.token_ids) + len(ids) >= self.max_model_len:
                    ep.done, ep.finish = True, "length"  # no room for the reply and a model token after it
                    continue
                ep.add_env_turn(ids, ep.versions[-1] if ep.versions else version)
        scored = [ep for ep in episodes if ep.state is not None]
        for ep, result in zip(scored, await self._env(env, "reward", [[ep.state] for ep in scored]) if scored else []):
            if result.error is not None:
                ep.fail(result.error, result.message)
            else:
                ep.reward = result.value
        if self.failures is not None:
            self.failures.record("env", env, [ep.error for ep in episodes])
        for ep in episodes:
            EPISODE_TURNS.observe(ep.turns)
            if tools or ep.tool_calls:
                EPISODE_TOOL_CALLS.observe(ep.tool_calls)
        version = self.engine.version
        return (
            [episode_sample(ep, version) for ep in episodes],
            [ep.model_mask for ep in episodes],
            [ep.reward for ep in episodes],
        )
