"""Tests for tasks.tools and the gsm8k_calculator task: schemas derived from signatures and
docstrings, <tool_call> parsing (malformed JSON and unclosed tags become tool error messages),
argument checks and raising tools answered as errors, the calculator's safety (ast only, bounded),
and whole gsm8k_calculator episodes from scripted model texts, in-process and through isolated
environment children (tasks.env.EnvCalls), rendered by the Qwen2.5 template of the tiny policy."""

from __future__ import annotations

import json

import pytest

from tasks.env import EnvCalls
from tasks.gsm8k_calculator import CALCULATOR_FORMAT_WEIGHT, ENV, calculator
from tasks.registry import get_task
from tasks.task import Task, render_messages
from tasks.tools import (
    MAX_TOOL_CALLS_PER_TURN,
    Tool,
    ToolCall,
    ToolCallError,
    ToolEnv,
    answer_tool_calls,
    function_schema,
    parse_tool_calls,
    run_tool_calls,
    tool_schemas,
)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def lookup(city: str, days: int = 1, metric: bool = True) -> dict:
    """Look up the weather.

    Args:
        city: the city's name,
            in English.
        days: how many days ahead.
    """
    if city == "nowhere":
        raise KeyError(city)
    return {"city": city, "days": days, "metric": metric}


LOOKUP = Tool.from_function(lookup)


def test_schema_comes_from_the_signature_and_docstring():
    assert function_schema(lookup) == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name, in English."},
                    "days": {"type": "integer", "description": "how many days ahead."},
                    "metric": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }
    assert function_schema(lookup, name="weather", description="d")["function"]["name"] == "weather"
    assert ENV.schemas[0]["function"]["parameters"]["required"] == ["expression"]


def test_schema_refuses_what_json_cannot_describe():
    def untyped(x):
        return x

    def star(*xs: int):
        return xs

    def odd(x: complex):
        return x

    for fn, match in ((untyped, "parameter 'x'"), (star, r"\*args"), (odd, "parameter 'x'")):
        with pytest.raises(TypeError, match=match):
            function_schema(fn)
    with pytest.raises(ValueError, match="unique"):
        tool_schemas([LOOKUP, LOOKUP])


def test_parse_reads_hermes_blocks_and_labels_malformed_ones():
    text = f"let me see {call('lookup', city='Oslo')} and {call('lookup', city='Rome', days=2)} done"
    assert parse_tool_calls(text) == [
        ToolCall("lookup", {"city": "Oslo"}),
        ToolCall("lookup", {"city": "Rome", "days": 2}),
    ]
    assert parse_tool_calls("the answer is 4\n#### 4") == []
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        ToolCall("f", {"a": 1})
    ]
    bad = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {1}}</tool_call><tool_call>[1]</tool_call>'
        '<tool_call>{"name": "f", "arguments": 3}</tool_call><tool_call>{"name": "f"'
    )
    assert [type(c) for c in bad] == [ToolCallError] * 4
    assert "not valid JSON" in bad[0].message and "JSON object" in bad[1].message
    assert "must be a JSON object" in bad[2].message and "not closed" in bad[3].message
    with pytest.raises(TypeError, match="as str"):
        parse_tool_calls(None)  # type: ignore[arg-type]


def test_every_failure_is_answered_as_a_tool_error_message():
    calls = parse_tool_calls(
        call("lookup", city="Oslo")
        + call("lookup")
        + call("lookup", city=3)
        + call("lookup", city="x", color="red")
        + call("nope")
        + call("lookup", city="nowhere")
        + "<tool_call>{oops}</tool_call>"
    )
    out, records = answer_tool_calls([LOOKUP], calls)
    assert out == run_tool_calls([LOOKUP], calls)
    assert records == [
        {"name": "lookup", "error": None},
        {"name": "lookup", "error": "bad_arguments"},
        {"name": "lookup", "error": "bad_arguments"},
        {"name": "lookup", "error": "bad_arguments"},
        {"name": "nope", "error": "unknown_tool"},
        {"name": "lookup", "error": "tool_raised"},
        {"name": None, "error": "parse_error"},
    ]
    assert [m["role"] for m in out] == ["tool"] * 7
    assert json.loads(out[0]["content"]) == {"city": "Oslo", "days": 1, "metric": True} and out[0]["name"] == "lookup"
    assert all(m["content"].startswith("Error: ") for m in out[1:])
    assert "missing arguments ['city']" in out[1]["content"] and "'city' must be of type string" in out[2]["content"]
    assert "unexpected arguments ['color']" in out[3]["content"] and "unknown tool 'nope'" in out[4]["content"]
    assert "KeyError" in out[5]["content"] and out[6]["name"] == "error" and "not valid JSON" in out[6]["content"]
    many = run_tool_calls([LOOKUP], [ToolCall("lookup", {"city": "a"})] * (MAX_TOOL_CALLS_PER_TURN + 3))
    assert len(many) == MAX_TOOL_CALLS_PER_TURN + 1 and "3 were not run" in many[-1]["content"]
    records = answer_tool_calls([LOOKUP], [ToolCall("lookup", {"city": "a"})] * (MAX_TOOL_CALLS_PER_TURN + 3))[1]
    assert [r["error"] for r in records] == [None] * MAX_TOOL_CALLS_PER_TURN + ["too_many_calls"] * 3


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", "7"),
        ("(48 / 2) * 3 + 1.5", "73.5"),
        ("10 / 4", "2.5"),
        ("-3 // 2", "-2"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("6 / 3", "2"),
        ("1 / 3", "0.3333333333"),
        ("0.1 + 0.2", "0.3"),
    ],
)
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, match",
    [
        ("__import__('os').system('true')", "not Call"),
        ("open('x')", "not Call"),
        ("x + 1", "not Name"),
        ("(1).__class__", "not Attribute"),
        ("[1, 2]", "not List"),
        ("1, 000", "not Tuple"),
        ("'a' * 3", "not Constant"),
        ("True + 1", "not Constant"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "power is too large"),
        ("10 ** 80", "power is too large"),
        ("1e70 * 1e70", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("2 ^ 3", "write \\*\\*"),
        ("1 +", "cannot parse"),
        ("1" * 201, "longer than"),
        ("-" * 100 + "1", "nested deeper"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, match):
    with pytest.raises(ValueError, match=match):
        calculator(expression)


def test_tool_env_ends_on_an_answer_and_scores_it():
    env = ToolEnv([LOOKUP], lambda text, info: float(text.strip() == info["answer"]), format_weight=0.5)
    state = env.reset({"answer": "42"})
    messages, done, state, stats = env.step(state, call("lookup", city="Oslo") + "<tool_call>{bad}</tool_call>")
    assert not done and [m["name"] for m in messages] == ["lookup", "error"]
    assert stats == {"tool_calls": [{"name": "lookup", "error": None}, {"name": None, "error": "parse_error"}]}
    assert (state["tool_calls"], state["tool_errors"]) == (2, 1) and env.reward(state) == 0.0  # no answer yet
    messages, done, state, stats = env.step(state, "42")
    assert stats == {"tool_calls": []}
    assert done and messages == [] and env.reward(state) == 1.0  # an error earlier: no format term
    clean = env.step(env.reset({"answer": "42"}), "42")[2]
    assert env.reward(clean) == 1.5 and env.reward(env.step(env.reset({"answer": "1"}), "42")[2]) == 0.5
    strict = ToolEnv(
        [LOOKUP], lambda text, info: 0.0, format_weight=0.5, answer_format=lambda text: text.startswith("A:")
    )
    assert strict.reward(strict.step(strict.reset({}), "A: 42")[2]) == 0.5
    assert strict.reward(strict.step(strict.reset({}), "42")[2]) == 0.0  # not the expected form: no format term
    with pytest.raises(TypeError, match="info as a dict"):
        env.reset("x")  # type: ignore[arg-type]


def test_tools_need_an_environment():
    with pytest.raises(ValueError, match="tools need an environment"):
        Task("t", lambda split, n, seed: [], tools=ENV.schemas)


def test_gsm8k_calculator_episode_through_isolated_children_renders_as_the_template_does():
    """A scripted episode: a good call, a malformed one, a wrong argument, then the right answer."""
    from policies.model_families import build_family_tokenizer

    task = get_task("gsm8k_calculator")
    assert task.env == "tasks.gsm8k_calculator:ENV" and task.max_turns == 4 and task.rewards == ()
    ex = task.load("eval", 1, 0)[0]  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2 -> 18
    assert ex["info"]["answer"] == "18"
    turns = [
        call("calculator", expression="16 - 3 - 4") + '<tool_call>{"name": "calculator", "arguments": {</tool_call>',
        call("calculator", expression="9 ** 9 ** 9"),
        call("calculator", expression="9 * 2"),
        "She makes 9 * 2 = 18 dollars.\n#### 18",
    ]
    envs = EnvCalls([task.env], timeout_s=10.0, num_procs=1)
    try:
        (reset,) = envs.call(task.env, "reset", [[ex["info"]]])
        state, replies = reset.value, []
        for text in turns:
            (result,) = envs.call(task.env, "step", [[state, text]])
            assert result.error is None
            messages, done, state = result.value
            replies.append(messages)
        (reward,) = envs.call(task.env, "reward", [[state]])
    finally:
        envs.close()
    assert done and state["answer"] == turns[-1] and (state["tool_calls"], state["tool_errors"]) == (4, 2)
    assert reward.value == 1.0  # right, but with tool errors: no format term
    assert [[m["content"] for m in ms] for ms in replies[:3]] == [
        [
            "9",
            "Error: the tool call is not valid JSON "
            "(Expecting property name enclosed in double quotes at character 37)",
        ],
        ["Error: calculator: ValueError: the power is too large"],
        ["18"],
    ]
    assert ENV.reward({**state, "tool_errors": 0}) == 1.0 + CALCULATOR_FORMAT_WEIGHT
    assert ENV.reward({**state, "tool_errors": 0, "answer": "She makes 18 dollars."}) == 1.0  # no '#### 18' line
    assert ENV.reward({**state, "tool_errors": 0, "answer": "gibberish"}) == 0.0
    # the whole conversation in the tiny policy's (Qwen2.5) template: tool schemas in the system
    # turn, each reply a user turn of <tool_response> blocks
    convo = render_messages(ex, task.system_prompt)
    for text, messages in zip(turns, replies + [[]]):
        convo += [{"role": "assistant", "content": text}, *messages]
    rendered = build_family_tokenizer("qwen2.5").apply_chat_template(convo, tools=list(task.tools), tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in rendered
    assert (
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n9\n</tool_response>\n<tool_response>\nError: "
        in rendered
    )
