"""verifiers environments as rlbus tasks: ``task.name: "verifiers:MODULE"`` trains on
``verifiers.load_environment(MODULE, **task.verifiers_args)``.

An agent task (:mod:`tasks.agent`) whose agent is :func:`rollout`: examples are the environment's
dataset rows (eval: its eval dataset, else a :func:`tasks.task.hash_split` of the prompt), each
carrying its row in ``info``; each sample runs ``env.run_rollout`` in an isolated child against the
producer's endpoint, and the rubric's ``state["reward"]`` is the term ``env``. Rubrics with group
reward functions are refused. ``verifiers`` is an optional extra, imported only where an
environment is loaded. User guide: docs/environments.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from typing import Any

from tasks.agent import CLIENT_TIMEOUT_S, EPISODE_HEADER
from tasks.task import Example, Task, hash_split

PREFIX = "verifiers:"
AGENT = "tasks.verifiers_env:rollout"
MODEL_NAME = "rlbus-policy"


def module_of(name: str) -> str:
    """``MODULE`` of ``"verifiers:MODULE"``; ValueError for another shape."""
    if not name.startswith(PREFIX) or not name[len(PREFIX) :].strip():
        raise ValueError(
            f"a verifiers task is named 'verifiers:MODULE' (MODULE: an importable module with "
            f"load_environment), got {name!r}"
        )
    return name[len(PREFIX) :].strip()


@functools.lru_cache(maxsize=8)
def _load(module: str, args_json: str) -> Any:
    import verifiers as vf

    try:
        env = vf.load_environment(module, **json.loads(args_json))
    except RuntimeError as exc:  # verifiers wraps what load_environment raised
        raise ValueError(f"verifiers environment {module!r} with task.verifiers_args={args_json}: {exc}") from exc
    if not isinstance(env, vf.Environment):
        raise TypeError(f"{module}.load_environment returned a {type(env).__name__}, not a verifiers.Environment")
    if env.requires_group_rollouts:
        raise ValueError(
            f"verifiers environment {module!r}: its rubric has group reward functions, which rlbus "
            "cannot score (each sample is an isolated rollout)"
        )
    return env


def load_env(module: str, args: dict[str, Any]) -> Any:
    """The ``verifiers.Environment`` of ``module`` with ``load_environment(**args)``, cached per process.
    ValueError when it cannot be loaded or has group rewards; TypeError for a non-Environment."""
    return _load(module, json.dumps(args, sort_keys=True))


def _jsonable(row: dict) -> dict:
    return json.loads(json.dumps(row, default=str))


def _prompt_text(messages: Any) -> str:
    """The last user message's text of a row's prompt."""
    if isinstance(messages, str):
        return messages
    for message in reversed(messages or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def load_examples(module: str, args: dict[str, Any], split: str, num_examples: int, seed: int) -> list[Example]:
    """At most ``num_examples`` examples of ``split``: train shuffled by ``seed``, eval in order."""
    env = load_env(module, args)
    has_eval = env.eval_dataset is not None or env.eval_dataset_source is not None
    rows = env.get_eval_dataset() if split == "eval" and has_eval else env.get_dataset()
    examples = []
    for k in range(len(rows)):
        row = _jsonable(dict(rows[k]))
        if not has_eval and hash_split(json.dumps(row.get("prompt"), sort_keys=True)) != split:
            continue
        examples.append(
            {
                "id": f"{split}-{row.get('example_id', k)}",
                "prompt": _prompt_text(row.get("prompt")),
                "info": {"verifiers": {"module": module, "args": args, "row": row}},
            }
        )
    if split == "train":
        random.Random(seed).shuffle(examples)
    return examples[:num_examples]


def make_task(name: str, args: dict[str, Any] | None = None) -> Task:
    """The task ``"verifiers:MODULE"`` (environment loaded on first use); ValueError for a bad name or
    ``args`` that are not JSON."""
    module, args = module_of(name), dict(args or {})
    try:
        json.dumps(args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task.verifiers_args must be JSON values: {exc}") from None
    return Task(name=name, load=functools.partial(load_examples, module, args), agent=AGENT)


async def _run(env: Any, row: dict, base_url: str, episode_id: str, api_key: str) -> dict:
    import openai
    import verifiers as vf

    native = openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        default_headers={EPISODE_HEADER: episode_id},
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
    )
    try:
        return await env.run_rollout(row, vf.OpenAIChatCompletionsClient(native), MODEL_NAME, {})
    finally:
        await native.close()


def rollout(client: Any, example: dict) -> float:
    """The agent of verifiers tasks: one rollout of the example's row; returns the rubric's reward.
    ValueError when ``example`` carries no verifiers row, or as :func:`load_env`."""
    spec = (example.get("info") or {}).get("verifiers")
    if not isinstance(spec, dict) or not isinstance(spec.get("row"), dict):
        raise ValueError("a verifiers rollout needs example['info']['verifiers'] = {'module', 'args', 'row'}")
    env = load_env(spec["module"], spec.get("args") or {})
    episode_id = client.default_headers[EPISODE_HEADER]
    out = asyncio.run(_run(env, spec["row"], str(client.base_url), episode_id, client.api_key))
    return float(out["reward"])
