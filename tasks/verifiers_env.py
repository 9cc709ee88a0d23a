"""verifiers environments as rlbus tasks: ``task.name: "verifiers:MODULE"`` trains on the
``verifiers`` package's environment ``MODULE.load_environment(**task.verifiers_args)`` (loaded with
``verifiers.load_environment``, so an installed environment package or any importable local module
with a ``load_environment`` function), its rollouts run against the producer's OpenAI-compatible
endpoint and its rubric's reward is the sample's reward.

How it maps (an agent task, :mod:`tasks.agent`, whose agent function is :func:`rollout`):

- examples: the environment's dataset rows (``env.get_dataset()``; the eval split is
  ``env.get_eval_dataset()`` when the environment has one, else the dataset's rows are split with
  :func:`tasks.task.hash_split` of their prompt so the splits never share a prompt). An example's
  ``prompt`` is the row's last user message text; its ``info`` carries the whole row (JSON) plus
  the module and arguments under ``"verifiers"``, so any process can run it. ``task.dataset``
  does not apply (the environment loads its own data); the train order is a seeded shuffle.
- rollout: per sample, in an isolated agent child, ``env.run_rollout(row, client, model,
  sampling_args={})`` with a ``verifiers.OpenAIChatCompletionsClient`` over an
  ``openai.AsyncOpenAI`` pointed at the endpoint with the episode header: every model call of the
  rollout is recorded into the sample's token-exact episode (:mod:`producers.endpoint_episodes`;
  the endpoint returns the model's ``<tool_call>`` blocks as OpenAI ``tool_calls``, so
  ``ToolEnv``/``MultiTurnEnv`` environments work). The run's sampling settings win over the
  environment's ``sampling_args``.
- reward: the rubric's ``state["reward"]`` (``Rubric.score_rollout``, weighted sum of its reward
  functions) is returned by the agent and becomes the group's reward term ``env``; the task has
  no other reward function.

Not supported: rubrics with group reward functions (``env.requires_group_rollouts``; each sample is
its own isolated call, so :func:`load_env` refuses them with ValueError),
environments that must talk to a non-chat API (completions-only, responses API) and
``EnvGroup`` of several environments with different datasets per task name.

``verifiers`` is an optional extra (``pip install rlbus[verifiers]``); it is imported only where an
environment is loaded (the prompt source and the agent children), never by this module's import.
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
    """The environment module of task name ``"verifiers:MODULE"``.

    Raises:
        ValueError: ``name`` does not start with ``"verifiers:"`` or names no module.
    """
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
    """The ``verifiers.Environment`` of ``module`` with ``load_environment(**args)`` (cached per
    process and arguments).

    Raises:
        ValueError: the module cannot be imported, its ``load_environment`` raised (the message
            names the module and arguments), or its rubric has group rewards.
        TypeError: ``load_environment`` returned no ``verifiers.Environment``.
    """
    return _load(module, json.dumps(args, sort_keys=True))


def _jsonable(row: dict) -> dict:
    return json.loads(json.dumps(row, default=str))


def _prompt_text(messages: Any) -> str:
    """The last user message's text of a row's prompt (a string prompt as it is)."""
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
    """``split``'s examples of the environment (module docstring), at most ``num_examples``; the
    train split in a ``seed``-shuffled order, the eval split in dataset order."""
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
    """The task ``"verifiers:MODULE"`` with ``load_environment`` arguments ``args`` (JSON values).
    The environment is loaded on the first :attr:`Task.load` call, not here.

    Raises:
        ValueError: as :func:`module_of`, or ``args`` are not JSON.
    """
    module, args = module_of(name), dict(args or {})
    try:
        json.dumps(args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task.verifiers_args must be JSON values: {exc}") from None
    return Task(name=name, load=functools.partial(load_examples, module, args), agent=AGENT)


async def _run(env: Any, row: dict, base_url: str, episode_id: str) -> dict:
    import openai
    import verifiers as vf

    native = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="rlbus",
        default_headers={EPISODE_HEADER: episode_id},
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
    )
    try:
        return await env.run_rollout(row, vf.OpenAIChatCompletionsClient(native), MODEL_NAME, {})
    finally:
        await native.close()


def rollout(client: Any, example: dict) -> float:
    """The agent function of verifiers tasks (:mod:`tasks.agent`): one rollout of the example's
    row against ``client``'s endpoint and episode; returns the rubric's reward.

    Raises:
        ValueError: ``example`` carries no verifiers row, or as :func:`load_env`.
    """
    spec = (example.get("info") or {}).get("verifiers")
    if not isinstance(spec, dict) or not isinstance(spec.get("row"), dict):
        raise ValueError("a verifiers rollout needs example['info']['verifiers'] = {'module', 'args', 'row'}")
    env = load_env(spec["module"], spec.get("args") or {})
    out = asyncio.run(_run(env, spec["row"], str(client.base_url), client.default_headers[EPISODE_HEADER]))
    return float(out["reward"])
