"""Agent functions for tests/producers/test_endpoint.py, imported by path in isolated children
(kept apart from the test module so the children do not import pytest or torch)."""

from __future__ import annotations


def two_turn_agent(client, example: dict) -> float:
    """Two chat turns through the official client: the prompt, then the model's answer and a user
    follow-up; the reward is the number of characters of the second answer, capped at 1."""
    messages = list(example["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0.3)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return min(1.0, float(len(second.choices[0].message.content or "")))


def raising_agent(client, example: dict) -> float:
    """One chat turn, then an exception (the episode keeps its tokens, reward 0, counted)."""
    client.chat.completions.create(model="policy", messages=example["messages"], max_tokens=4)
    raise RuntimeError("the agent broke")
