"""Environments for the multi-turn tests, referenced by import path (``f"{misbehaving_envs.__name__}:ByText"``)
so they resolve in the isolation children too. ``ByText.step`` misbehaves on demand: the model's text
``hang`` sleeps past every timeout, ``crash`` ends the child's interpreter, ``raise`` raises,
``bad`` returns a malformed result; any other text is answered with a user turn ``"more <k>"``
until ``info["turns"]`` model turns are done. The reward is the number of model turns seen."""

from __future__ import annotations

import os
import time


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
        return ([] if done else [{"role": "user", "content": f"more {seen}"}]), done, {**state, "seen": seen}

    @staticmethod
    def reward(state: dict) -> float:
        return float(state["seen"])
