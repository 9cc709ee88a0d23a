"""Reward functions written as in TRL's documentation (``docs/source/grpo_trainer.md``, "Using a
custom reward function"; the quickstart's ``reward_len``), referenced from the tests as
``trl:trl_reward_fns:NAME`` so they resolve in the reward children too. Only the signatures and
bodies a TRL user would write: nothing rlbus-specific."""

from __future__ import annotations

import asyncio
import re


def reward_len(completions, **kwargs):
    """TRL quickstart: rewards completions close to 20 characters (standard format)."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """TRL docs, example 2 (conversational format): checks the <think>/<answer> format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    """TRL docs, example 3 (standard format, dataset column ``ground_truth``): \\boxed{} answer."""
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def token_count(completion_ids, **kwargs):
    """TRL docs, example 1: rewards longer completions (in tokens)."""
    return [float(len(ids)) for ids in completion_ids]


def math_reward_func(prompts, completions, task, **kwargs):
    """TRL docs, example 4 (multi-task): None where the reward does not apply."""
    return [(1.0 if "4" in completion else -1.0) if t == "math" else None for completion, t in zip(completions, task)]


def curriculum(completions, trainer_state, **kwargs):
    """A curriculum reward: the share of training done, read from ``trainer_state``."""
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]


def logs_metric(completions, log_metric, **kwargs):
    """Logs a metric with TRL's ``log_metric`` hook and rewards the length in characters."""
    lengths = [float(len(c)) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    return lengths


async def async_len(completions, **kwargs):
    """An ``async def`` reward (TRL runs those to completion)."""
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def one_reward(completions, **kwargs):
    """Broken: one reward for the whole group."""
    return [1.0]


def overlong(completions, **kwargs):
    """A reward whose name collides with the overlong shaping's term."""
    return [0.0 for _ in completions]


def reverses_the_question(prompts, completions, **kwargs):
    """Conversational format, reading the prompt as TRL gives it (``prompts[i][-1]["content"]``: the
    user's message): 1 for a completion that is the user's message reversed, plus 0.5 when the
    prompt opens with a system message."""
    return [
        float(completion[0]["content"] == prompt[-1]["content"][::-1]) + 0.5 * (prompt[0]["role"] == "system")
        for prompt, completion in zip(prompts, completions)
    ]


def prompt_is_the_first_word(prompts, completions, words, **kwargs):
    """Conversational format, for a reverse_turns run (dataset column ``words``): 1 where the prompt
    is the episode's initial chat, one user message holding the first word (no environment turn)."""
    return [float(prompt == [{"role": "user", "content": w[0]}]) for prompt, w in zip(prompts, words)]
