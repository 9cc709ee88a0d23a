"""Multi-turn episodes in a producer: model turns sampled by vLLM, environment turns rendered by the
chat template, one token-exact trajectory per sample.

For a prompt of a task with an environment (``Task.env``, protocol in :mod:`tasks.env`), each of
the ``n`` samples of the group is an episode:

1. ``reset(info)`` builds the episode's state (isolated, :class:`tasks.env.EnvCalls`);
2. a model turn: vLLM samples from the token ids so far (prompt + every earlier turn, passed as
   token ids, never re-tokenized text) with ``n=1`` and the sample's own seed; its token ids,
   sampled logprobs and per-token policy versions are appended as they are (loss mask True);
3. ``step(state, text)`` with the turn's decoded text returns the environment's messages and
   ``done``; unless done (or ``max_turns`` model turns, or no room left under ``max_model_len``
   for the environment's turn and one more model token: finish reason ``"length"``),
   ONLY those messages are rendered with the chat template as a token suffix
   (:func:`env_turn_ids`) and appended with logprob 0, loss mask False and the version of the turn's
   last model token; back to 2;
4. ``reward(state)`` gives the episode's reward (``RolloutGroup.env_rewards``).

Token-exactness: the model's tokens are the ones vLLM sampled; the environment's tokens are the
template's rendering of its turn, cut after the end of the previous assistant turn, so the whole
trajectory is what the template would give for the conversation except that the model turns keep
their sampled ids (a model turn cut by ``max_tokens`` gets the end-of-turn token prepended to the
environment suffix, as an environment token).

Failures: an environment call that raises, times out, crashes its child or returns a malformed
result ends that episode with reward 0 and finish reason ``"env_error: <label>"``, counted in
``rlbus_producer_env_errors_total{error}``; the other episodes and the producer go on.

Tool calls: a step's statistics (:mod:`tasks.env`; :class:`tasks.tools.ToolEnv` returns them)
are counted per tool and error kind and per episode (:mod:`producers.turn_metrics`).

Design hook for other generation paths (an OpenAI-compatible endpoint, verifiers): everything an
episode needs from a model turn is an engine ``Sample`` (token ids, logprobs, token versions);
:class:`Episode` accumulates turns from any source with :meth:`Episode.add_model_turn` and
:meth:`Episode.add_env_turn`, and :func:`episode_sample` turns it into the group's sample.
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
    """Token ids of the environment's turn ``messages`` as the chat template renders them after an
    assistant turn, up to and including the next assistant generation prompt.

    Renders ``[user, assistant(MARKER)]`` and the same plus ``messages`` with the generation
    prompt, checks the first is a prefix of the second up to the end of the assistant turn (the
    marker and the template's end-of-turn token text right after it), and tokenizes the rest:
    the newline after the end-of-turn token, the new turns' markers and contents, and the next
    ``<|im_start|>assistant\\n`` (for a ChatML template). ``tools``: the task's function schemas
    (:attr:`tasks.task.Task.tools`), rendered as the prompt was (``role: tool`` messages render
    as the template's tool turn, e.g. Qwen's ``<tool_response>`` blocks in a user turn).

    Raises:
        ValueError: the template renders the earlier turns differently once ``messages`` follow
            (the suffix would not be token-exact).
    """
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
    """One sample's trajectory so far: ``token_ids``, ``logprobs``, ``versions`` and ``model_mask``
    (True on model tokens), one entry per completion token; the env ``state``; ``turns`` (model
    turns); ``tool_calls`` (as the environment's step statistics reported them); ``finish`` (the
    last model turn's finish reason, or ``"env_error: <label>"``)."""

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

    def add_model_turn(self, sample: Sample, default_version: int) -> None:
        """Append one model turn's sampled tokens (``sample.token_versions``, or ``default_version``
        for every token when it has none)."""
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

    def fail(self, error: str) -> None:
        """End the episode with reward 0 and reason ``env_error: <error>`` (counted)."""
        ENV_ERRORS_TOTAL.labels(error).inc()
        self.done, self.state, self.reward, self.finish = True, None, 0.0, f"env_error: {error}"


def episode_sample(ep: Episode, version: int) -> Sample:
    """The episode as one engine :class:`Sample` (``version``: for an episode without tokens)."""
    versions = ep.versions or [version]
    return Sample(
        list(ep.token_ids), list(ep.logprobs), "", ep.finish, min(versions), max(versions), (), tuple(ep.versions)
    )


class EpisodeRunner:
    """Runs multi-turn groups: a producer's engine, tokenizer and isolated environments.

    Args:
        engine: the producer's :class:`producers.engine.RolloutEngine` (or anything with its
            ``generate_group`` and ``version``).
        tokenizer: the policy's Hugging Face tokenizer (chat template, eos).
        envs: the environment pool (:class:`tasks.env.EnvCalls`); called from one thread at a time
            (a lock here serializes the groups' calls).
        max_model_len: prompt + completion limit, tokens: an episode ends when no token is left.
        tools: the function schemas of the run's tool-use tasks (their names' metric labels are
            created at 0 now, :func:`producers.turn_metrics.preinit_tools`).
    """

    def __init__(
        self, engine: Any, tokenizer: Any, envs: EnvCalls, *, max_model_len: int, tools: list[dict] | None = None
    ) -> None:
        self.engine, self.tokenizer, self.envs, self.max_model_len = engine, tokenizer, envs, max_model_len
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
        """Run ``kwargs["n"]`` episodes of ``env`` from ``prompt_ids``; ``kwargs`` are
        :func:`producers.sampling.request_kwargs` (``n``, ``seed``, ``max_tokens``, ...; each
        model turn of sample ``j`` is one request with ``n=1`` and seed ``seed + j``); ``tools``:
        the task's function schemas, as the prompt was rendered with (:func:`env_turn_ids`).

        Returns:
            ``(samples, model_masks, rewards)``: one :class:`Sample` per episode (completion =
            model and environment tokens interleaved), its ``[L_j]`` model-token mask, its reward.

        Raises:
            RuntimeError, ValueError: from the engine (e.g. a prompt longer than ``max_model_len``)
                or from :func:`env_turn_ids`; environment failures never raise.
        """
        n, seed, max_tokens = kwargs.pop("n"), kwargs.pop("seed"), kwargs.pop("max_tokens")
        known = schema_names(tools)
        episodes = [Episode() for _ in range(n)]
        for ep, result in zip(episodes, await self._env(env, "reset", [[info]] * n)):
            if result.error is not None:
                ep.fail(result.error)
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
                    ep.fail(result.error)
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
                ep.fail(result.error)
            else:
                ep.reward = result.value
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
