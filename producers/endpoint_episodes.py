"""Episodes recorded by a producer's OpenAI-compatible endpoint, and their assembly into one
token-exact trajectory (pure logic: no sockets, no vLLM; :mod:`producers.endpoint` serves).

A client names its episode on every request (header ``X-Rlbus-Episode``, or the request's ``user``
field); the producer opens the episode first (:meth:`EndpointEpisodes.open`, with the run's
sampling settings) and closes it after the agent returns (:meth:`EndpointEpisodes.close`). Each
response of an open episode is recorded as a :class:`RecordedTurn`: the prompt token ids, the
sampled token ids with their logprobs and per-token policy versions.

Chat prompts of an open episode are built so that they extend the trajectory: when the request's
messages are the previous turn's messages plus the assistant message carrying exactly the text
returned for it, plus new messages, the prompt is the previous prompt + the sampled ids (never
re-tokenized) + the chat template's rendering of the new messages only
(:func:`producers.episodes.env_turn_ids`, with the end-of-turn token first if the sampled turn did
not end with it). Any other request is rendered by the template from scratch.

Assembly (:func:`assemble_episode`): the first turn's prompt is the episode's prompt; each later
turn's prompt must start with the trajectory so far (previous prompt + sampled ids); the tokens
after it are environment tokens (loss mask False, logprob 0, the version of the last model
token). A turn whose prompt does not extend the trajectory (the client rewrote the history, or
sent text the template renders differently) is never re-tokenized into the episode: the episode
ends before it and the episode counts as rebased
(``rlbus_producer_endpoint_rebased_episodes_total``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from prometheus_client import Counter

from producers.engine import Sample
from producers.episodes import Episode, env_turn_ids

EPISODE_HEADER = "X-Rlbus-Episode"

ENDPOINT_EPISODES = Counter("rlbus_producer_endpoint_episodes_total",
                            "Episodes recorded by the OpenAI-compatible endpoint, by outcome: complete, rebased "
                            "(a turn did not extend the trajectory: the episode ends before it), empty (no request)",
                            ["outcome"])
for _outcome in ("complete", "rebased", "empty"):
    ENDPOINT_EPISODES.labels(_outcome)


@dataclasses.dataclass(frozen=True)
class RecordedTurn:
    """One response of an episode: ``prompt_ids`` ``[P] int``, the engine's ``sample`` (sampled
    ids, logprobs, token versions), ``version`` (the engine's when the request was issued),
    ``messages`` (the chat request's messages; None for ``/v1/completions``) and ``text`` (the
    text returned to the client)."""

    prompt_ids: list[int]
    sample: Sample
    version: int
    messages: list[dict] | None
    text: str


@dataclasses.dataclass
class _Open:
    sampling: dict[str, Any]
    turns: list[RecordedTurn] = dataclasses.field(default_factory=list)


class EndpointEpisodes:
    """The open episodes of one endpoint, by id; safe to use from several threads."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    def open(self, episode_id: str, sampling: dict[str, Any]) -> None:
        """Start recording ``episode_id``; its requests sample with ``sampling`` (keyword arguments
        of :meth:`producers.engine.RolloutEngine.generate_group` other than the prompt, ``n`` and
        ``request_id``), whatever the client asks for.

        Raises:
            ValueError: ``episode_id`` is empty or already open.
        """
        with self._lock:
            if not episode_id or episode_id in self._open:
                raise ValueError(f"episode id {episode_id!r} is empty or already open")
            self._open[episode_id] = _Open(dict(sampling))

    def sampling(self, episode_id: str) -> dict[str, Any] | None:
        """The sampling settings of open episode ``episode_id``; None if it is not open."""
        with self._lock:
            ep = self._open.get(episode_id)
            return None if ep is None else dict(ep.sampling)

    def last_turn(self, episode_id: str) -> RecordedTurn | None:
        """The latest recorded turn of ``episode_id`` (None: none yet, or not open)."""
        with self._lock:
            ep = self._open.get(episode_id)
            return ep.turns[-1] if ep is not None and ep.turns else None

    def record(self, episode_id: str, turn: RecordedTurn) -> bool:
        """Append ``turn`` to ``episode_id``; False (nothing recorded) if it is no longer open."""
        with self._lock:
            ep = self._open.get(episode_id)
            if ep is not None:
                ep.turns.append(turn)
            return ep is not None

    def close(self, episode_id: str) -> list[RecordedTurn]:
        """Stop recording ``episode_id`` and return its turns in order (``[]`` if unknown)."""
        with self._lock:
            ep = self._open.pop(episode_id, None)
        return [] if ep is None else ep.turns


def chat_prompt_ids(tokenizer: Any, messages: list[dict], last: RecordedTurn | None, *,
                    tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids of a chat request (module docstring): the trajectory of ``last`` extended by
    the template's rendering of the new messages when ``messages`` continue it, else the whole
    conversation rendered by the template with the generation prompt."""
    if last is not None and last.messages is not None and not tools:
        k = len(last.messages)
        if (len(messages) > k + 1 and messages[:k] == last.messages and messages[k].get("role") == "assistant"
                and messages[k].get("content") == last.text and not messages[k].get("tool_calls")):
            ids = list(last.sample.token_ids)
            eos = tokenizer.eos_token_id
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)  # a turn cut by max_tokens or a stop string: close it as the template would
            return last.prompt_ids + ids + env_turn_ids(tokenizer, messages[k + 1:])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools or None)
    return tokenizer.encode(text, add_special_tokens=False)


def assemble_episode(turns: list[RecordedTurn]) -> tuple[list[int], Episode, bool]:
    """One trajectory from an episode's turns (module docstring).

    Returns:
        ``(prompt_ids, episode, rebased)``: the first turn's prompt ``[P] int`` (``[]`` without
        turns), the :class:`producers.episodes.Episode` (model turns with the engine's logprobs and
        versions, environment tokens in between; ``finish`` the last kept turn's), and whether a
        turn was left out because its prompt did not extend the trajectory (the episode ends
        before it). Counted in ``rlbus_producer_endpoint_episodes_total{outcome}``.
    """
    ep = Episode()
    if not turns:
        ENDPOINT_EPISODES.labels("empty").inc()
        return [], ep, False
    prompt = list(turns[0].prompt_ids)
    rebased = False
    for i, turn in enumerate(turns):
        if i:
            so_far = prompt + ep.token_ids
            if turn.prompt_ids[:len(so_far)] != so_far:
                rebased = True
                break
            ep.add_env_turn(turn.prompt_ids[len(so_far):], ep.versions[-1] if ep.versions else turn.version)
        ep.add_model_turn(turn.sample, turn.version)
    ep.done = True
    ENDPOINT_EPISODES.labels("rebased" if rebased else "complete").inc()
    return prompt, ep, rebased
