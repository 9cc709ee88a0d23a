"""Environments for the multi-turn tests, referenced by import path (``f"{misbehaving_envs.__name__}:ByText"``)
so they resolve in the isolated children too. ``ByText.step`` misbehaves on demand: the model's text
``hang`` sleeps past every timeout, ``crash`` ends the child's interpreter, ``raise`` raises,
``bad`` returns a malformed result, ``stats:<json>`` answers as usual with the step statistics
``<json>`` as a fourth element (``stats5:<json>``: and a fifth, malformed); any other text is answered
with a user turn ``"more <k>"`` until ``info["turns"]`` model turns are done. The reward is the number
of model turns seen. :func:`faulty_task` is a whole task whose environment hangs, crashes or raises on
some model texts (for end-to-end runs)."""

from __future__ import annotations

import json
import os
import time
import zlib

from tasks.reverse_text import reverse_text_examples
from tasks.task import Task


class ByText:
    @staticmethod
    def reset(info: dict) -> dict:
        if info.get("reset") == "raise":
            raise RuntimeError("cannot reset")
        return {"turns": int(info.get("turns", 2)), "seen": 0}

    @staticmethod
    def step(state: dict, text: str) -> tuple[list, bool, dict]:
        word = text.strip()
        if word == "hang":
            time.sleep(60)
        if word == "crash":
            os._exit(3)
        if word == "raise":
            raise KeyError("no such move")
        if word == "bad":
            return "not a list", 1, None  # type: ignore[return-value]
        seen = state["seen"] + 1
        done = seen >= state["turns"]
        result = ([] if done else [{"role": "user", "content": f"more {seen}"}]), done, {**state, "seen": seen}
        kind, _, stats = word.partition(":")
        if kind in ("stats", "stats5"):
            return (*result, json.loads(stats), *[{}] * (kind == "stats5"))  # type: ignore[return-value]
        return result

    @staticmethod
    def reward(state: dict) -> float:
        return float(state["seen"])


def _fault(text: str) -> str:
    """``"hang"``, ``"crash"``, ``"raise"`` or ``""`` (well behaved), fixed by the text's crc32:
    about 1 in 8 texts each."""
    return {0: "hang", 1: "crash", 2: "raise"}.get(zlib.crc32(text.encode()) % 8, "")


class Faulty:
    """A reverse_turns-like environment for whole runs that misbehaves on some model texts
    (:func:`_fault`): hangs, crashes its child, or raises; otherwise it answers once with a user
    turn and scores the episode by the length of the model's texts (so rewards differ in a group)."""

    @staticmethod
    def reset(info: dict) -> dict:
        return {"lengths": []}

    @staticmethod
    def step(state: dict, text: str) -> tuple[list, bool, dict]:
        fault = _fault(text)
        if fault == "hang":
            time.sleep(60)
        elif fault == "crash":
            os._exit(3)
        elif fault == "raise":
            raise ValueError("a move this environment does not know")
        lengths = [*state["lengths"], len(text)]
        done = len(lengths) >= 2
        return ([] if done else [{"role": "user", "content": "again"}]), done, {"lengths": lengths}

    @staticmethod
    def reward(state: dict) -> float:
        return sum(state["lengths"]) / 32.0


def faulty_task() -> Task:
    """A custom multi-turn task (``task.name: tests.tasks.misbehaving_envs:faulty_task``) with the
    :class:`Faulty` environment and reverse_text's prompts."""
    return Task("faulty", reverse_text_examples, None, (), env="tests.tasks.misbehaving_envs:Faulty", max_turns=2)


def agent_raises(client: object, example: dict) -> float:
    """An agent (``task.agent``) that fails before it calls the model."""
    raise ConnectionError(f"no route to the tool server for {example['info'].get('id', '?')}")
