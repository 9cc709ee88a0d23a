"""The endpoint's tool-call replies (producers.endpoint_episodes.reply_message, same_reply) as
pure logic: which sampled texts become OpenAI ``tool_calls``, and which assistant messages sent
back continue the recorded turn. The served path (real vLLM, the openai client, verifiers' ToolEnv)
is tests/producers/test_verifiers_envs.py."""

from __future__ import annotations

import json

from producers.endpoint_episodes import RecordedTurn, reply_message, same_reply
from producers.rollout_sample import Sample

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def _turn(text: str, tools=TOOLS) -> RecordedTurn:
    sample = Sample(token_ids=[1], logprobs=[0.0], text=text, finish_reason="stop", version_start=0, version_end=0)
    return RecordedTurn([0], sample, 0, [], text, reply_message(text, tools, "call_x"))


def test_well_formed_blocks_become_tool_calls_with_the_rest_as_content():
    reply = reply_message("Let me add. " + CALL + CALL.replace('"a": 2', '"a": 4'), TOOLS, "call_r")
    assert reply["content"] == "Let me add."
    assert [c["id"] for c in reply["tool_calls"]] == ["call_r_0", "call_r_1"]
    assert all(c["type"] == "function" and c["function"]["name"] == "add" for c in reply["tool_calls"])
    assert [json.loads(c["function"]["arguments"]) for c in reply["tool_calls"]] == [{"a": 2, "b": 3}, {"a": 4, "b": 3}]
    assert reply_message(CALL, TOOLS, "c")["content"] is None


def test_no_tools_no_block_or_a_malformed_block_keep_the_text():
    assert reply_message(CALL, None, "c") == {"role": "assistant", "content": CALL}  # no tools in the request
    assert reply_message("5", TOOLS, "c") == {"role": "assistant", "content": "5"}
    for text in (CALL + "<tool_call>{not json}</tool_call>", CALL + "<tool_call>{", "<tool_call>[1]</tool_call>"):
        assert reply_message(text, TOOLS, "c") == {"role": "assistant", "content": text}


def test_the_assistant_message_sent_back_must_be_the_reply():
    turn = _turn(CALL)
    call = dict(turn.reply["tool_calls"][0])
    assert same_reply({"role": "assistant", "content": None, "tool_calls": [call]}, turn)
    assert same_reply({"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": None}, turn)
    spaced = {**call, "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}  # the same JSON, re-serialized
    assert same_reply({"role": "assistant", "content": None, "tool_calls": [spaced]}, turn)
    other = {**call, "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}
    assert not same_reply({"role": "assistant", "content": None, "tool_calls": [other]}, turn)
    assert not same_reply({"role": "assistant", "content": None, "tool_calls": [{**call, "id": "call_y_0"}]}, turn)
    assert not same_reply({"role": "assistant", "content": CALL}, turn)  # as text: not what was returned
    assert not same_reply({"role": "assistant", "content": None, "tool_calls": ["bad"]}, turn)
    assert not same_reply({"role": "user", "content": None, "tool_calls": [call]}, turn)
    plain = _turn("5")
    assert same_reply({"role": "assistant", "content": "5"}, plain) and not same_reply(
        {"role": "assistant", "content": "6"}, plain
    )
