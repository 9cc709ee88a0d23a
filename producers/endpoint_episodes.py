"""Episodes recorded by a producer's OpenAI-compatible endpoint and their assembly into one token-exact trajectory
(pure logic, no sockets or vLLM; :mod:`producers.endpoint` serves).

The producer opens an episode with the run's sampling settings and closes it after the agent returns; each
response is a :class:`RecordedTurn`. A chat request that continues the previous turn exactly (its messages, the
assistant reply as returned, :func:`same_reply`, then new messages) is prompted with the previous prompt + the
sampled ids + the template's rendering of the new messages only, never re-tokenized. :func:`assemble_episode`
makes the tokens between turns environment tokens; a turn whose prompt does not extend the trajectory ends the
episode before it (``rlbus_producer_endpoint_episodes_total{outcome="rebased"}``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any

from prometheus_client import Counter

from producers.rollout_sample import Sample
from producers.episodes import Episode, env_turn_ids
from tasks.tools import ToolCall, parse_tool_calls

EPISODE_HEADER = "X-Rlbus-Episode"
_CALL_BLOCKS = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)

ENDPOINT_EPISODES = Counter(
    "rlbus_producer_endpoint_episodes_total",
    "Episodes recorded by the OpenAI-compatible endpoint, by outcome: complete, rebased "
    "(a turn did not extend the trajectory: the episode ends before it), empty (no request)",
    ["outcome"],
)
for _outcome in ("complete", "rebased", "empty"):
    ENDPOINT_EPISODES.labels(_outcome)


@dataclasses.dataclass(frozen=True)
class RecordedTurn:
    """One response: ``prompt_ids`` ``[P] int``, the engine's ``sample``, the engine ``version`` at issue, and
    for chat the request's ``messages`` and the ``reply`` returned (None for ``/v1/completions``)."""

    prompt_ids: list[int]
    sample: Sample
    version: int
    messages: list[dict] | None
    text: str
    reply: dict | None = None


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
        """Record ``episode_id``, sampling with ``sampling`` (``generate_group`` kwargs) whatever the client asks.

        Raises ValueError: ``episode_id`` is empty or already open.
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


def reply_message(text: str, tools: list | None, call_id: str) -> dict:
    """The assistant message for the sampled ``text``: with ``tools`` and only well-formed Qwen/Hermes
    ``<tool_call>`` blocks, OpenAI ``tool_calls`` (ids ``f"{call_id}_{i}"``, arguments as JSON) and the text
    outside them as ``content`` (None if blank); otherwise the text as the model wrote it."""
    calls = parse_tool_calls(text) if tools else []
    if not calls or not all(isinstance(c, ToolCall) for c in calls):
        return {"role": "assistant", "content": text}
    rest = _CALL_BLOCKS.sub("", text).strip()
    return {
        "role": "assistant",
        "content": rest or None,
        "tool_calls": [
            {
                "id": f"{call_id}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ],
    }


def _calls_of(message: dict) -> list[tuple] | None:
    """``[(id, name, arguments as JSON)]`` of an assistant message's tool calls (None: malformed)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return None
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            return None
        out.append((call.get("id"), fn.get("name"), args))
    return out


def same_reply(sent: dict, last: RecordedTurn) -> bool:
    """Whether ``sent`` is the assistant message returned for ``last`` (content, tool call ids/names/args)."""
    reply = last.reply if last.reply is not None else {"role": "assistant", "content": last.text}
    if sent.get("role") != "assistant" or (sent.get("content") or "") != (reply.get("content") or ""):
        return False
    calls = _calls_of(sent)
    return calls is not None and calls == _calls_of(reply)


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict], last: RecordedTurn | None, *, tools: list[dict] | None = None
) -> list[int]:
    """A chat request's prompt ids: ``last``'s trajectory + the new messages' rendering when ``messages``
    continue it, else the whole conversation rendered with the generation prompt."""
    if last is not None and last.messages is not None:
        k = len(last.messages)
        if len(messages) > k + 1 and messages[:k] == last.messages and same_reply(messages[k], last):
            ids = list(last.sample.token_ids)
            eos = tokenizer.eos_token_id
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)  # a turn cut by max_tokens or a stop string: close it as the template would
            return last.prompt_ids + ids + env_turn_ids(tokenizer, messages[k + 1 :], tools=tools or None)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools or None)
    return tokenizer.encode(text, add_special_tokens=False)


def assemble_episode(turns: list[RecordedTurn]) -> tuple[list[int], Episode, bool]:
    """``(prompt_ids, episode, rebased)``: the first prompt ``[P] int`` (``[]`` without turns), the
    :class:`Episode` (environment tokens between model turns) and whether it ended early at a rebase (counted)."""
    ep = Episode()
    if not turns:
        ENDPOINT_EPISODES.labels("empty").inc()
        return [], ep, False
    prompt = list(turns[0].prompt_ids)
    rebased = False
    for i, turn in enumerate(turns):
        if i:
            so_far = prompt + ep.token_ids
            if turn.prompt_ids[: len(so_far)] != so_far:
                rebased = True
                break
            ep.add_env_turn(turn.prompt_ids[len(so_far) :], ep.versions[-1] if ep.versions else turn.version)
        ep.add_model_turn(turn.sample, turn.version)
    ep.done = True
    ENDPOINT_EPISODES.labels("rebased" if rebased else "complete").inc()
    return prompt, ep, rebased
