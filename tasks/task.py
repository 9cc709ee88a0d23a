"""The :class:`Task` type and what every task shares: splits, prompt rendering, completion cleanup.

A task (one module per built-in task: :mod:`tasks.reverse_text`, :mod:`tasks.gsm8k`,
:mod:`tasks.countdown`) names a loader of examples (one split at a time), an optional system
prompt and its weighted reward functions. A task example is a plain, JSON-able dict::

    {"id": str, "prompt": str (the user message text), "info": dict}

``info`` travels with the prompt through the bus to the reward workers, which call each of the
task's reward functions ``fn(completion, info) -> float`` (see :mod:`tasks.rewards`) and add them
up with their weights. :func:`render_messages` turns an example into chat messages for the
policy's chat template (the producer applies the template).

Invariants:

* Splits are ``"train"`` and ``"eval"`` (``KNOWN_SPLITS``); they never share a prompt.
* Synthetic tasks make the splits disjoint *by construction*, whatever their seeds: an item
  belongs to the eval split iff the first byte of ``sha256(key)`` is below ``EVAL_BUCKET_BYTES``
  (1/16 of all items) (:func:`hash_split`), and a split keeps only its own items.

No heavy imports here: a reward worker's child process imports this module to score
``reverse_text``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

KNOWN_SPLITS = ("train", "eval")
# First sha256 byte < 16 -> eval split (1/16 of the key space).
EVAL_BUCKET_BYTES = 16
# End-of-turn tokens a producer may leave at the end of a completion's text.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")

Example = dict[str, Any]
Loader = Callable[[str, int, int], list[Example]]


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its examples, prompt rendering and reward functions.

    Fields:
        name: the name prompts and groups carry (``Prompt.task``): the registered name, or the
            import path for a custom task.
        load: ``(split "train"|"eval", num_examples, seed) -> [example]``, deterministic in its
            arguments (see :func:`tasks.registry.load_task_examples`).
        system_prompt: the system message before every prompt, or None for none.
        rewards: ``((reward ref, weight), ...)``: registered reward names or import paths
            ``"package.module:function"``; reward = sum of weight * score.
        env: for a multi-turn task, the import path ``"package.module:Object"`` of its environment
            (:mod:`tasks.env`); its reward joins the group's rewards as the term ``env``. None: a
            single-turn task.
        max_turns: most model turns of an episode (``env`` tasks; >= 1).
        tools: function-calling schemas (:func:`tasks.tools.tool_schemas`) the producer passes to
            the chat template (``tools=``) when it renders the prompt and the environment's turns;
            ``env`` tasks only (the environment runs the calls, :class:`tasks.tools.ToolEnv`).
        agent: the import path of the task's own agent function (:mod:`tasks.agent`), run per
            sample against the producer's OpenAI-compatible endpoint; its return value is the
            reward term ``env`` (a verifiers task, :mod:`tasks.verifiers_env`). None: the run's
            ``task.agent`` if set, else no agent.

    Raises:
        ValueError: ``tools`` without ``env``, or ``env`` and ``agent`` both set.
    """

    name: str
    load: Loader
    system_prompt: str | None = None
    rewards: tuple[tuple[str, float], ...] = ()
    env: str | None = None
    max_turns: int = 1
    tools: tuple[dict[str, Any], ...] = ()
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.tools and self.env is None:
            raise ValueError(f"task {self.name!r}: tools need an environment (Task.env) to run the calls")
        if self.env is not None and self.agent is not None:
            raise ValueError(
                f"task {self.name!r}: an environment (Task.env) and an agent (Task.agent) exclude each other"
            )


def check_request(split: str, num_examples: int) -> None:
    """Validate a loader request.

    Raises:
        ValueError: ``split`` is not one of ``KNOWN_SPLITS`` or ``num_examples < 0``.
    """
    if split not in KNOWN_SPLITS:
        raise ValueError(f"unknown split={split!r}; known splits: {', '.join(KNOWN_SPLITS)}")
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")


def hash_split(key: str) -> str:
    """The split (``"train"`` or ``"eval"``) that owns the item with canonical ``key``: ``"eval"``
    iff the first byte of ``sha256(key)`` is below ``EVAL_BUCKET_BYTES``."""
    return "eval" if hashlib.sha256(key.encode()).digest()[0] < EVAL_BUCKET_BYTES else "train"


def render_messages(example: Example, system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages for one example: an optional system turn (the task's ``system_prompt``), then
    the user turn.

    reverse_text uses no system prompt: the tiny policy learns the task from the data, and every
    prompt token costs compute on 2 CPU cores.
    """
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": example["prompt"]})
    return messages


def strip_end_of_turn(completion: str) -> str:
    """Remove surrounding whitespace and any trailing end-of-turn tokens (``END_OF_TURN_TOKENS``,
    left when a producer keeps special tokens in the text) from ``completion``."""
    text = completion.strip()
    stripped = True
    while stripped:
        stripped = False
        for token in END_OF_TURN_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                stripped = True
    return text.lstrip()
