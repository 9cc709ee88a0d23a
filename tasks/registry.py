"""The task registry: task names, the custom-task hook, eval tasks and the reward spec.

Registered tasks (``KNOWN_TASKS``) are stored as import paths of their ``make_task`` and imported
on first use (a ``reverse_text`` run never imports math-verify). ``"verifiers:MODULE"`` is a
verifiers environment (:mod:`tasks.verifiers_env`); any other ``"package.module:function"`` is a
custom task returning a :class:`tasks.task.Task` (configs are trusted). ``get_task(name, task_cfg)``
applies the ``task`` section's overrides whenever ``task_cfg.name == name``, so the eval task of
the training task gets them too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from configs.rollout import DatasetConfig, EvalTaskConfig, TaskConfig
from configs.schema import RunConfig
from tasks.import_path import add_import_paths, import_callable
from tasks.task import Example, Task, check_request
from tasks.verifiers_env import PREFIX as VERIFIERS_PREFIX
from tasks.verifiers_env import make_task as make_verifiers_task

DEFAULT_TASK = "reverse_text"

# name -> import path of its ``make_task`` (file tasks take the ``task.dataset`` section).
_TASKS: dict[str, str] = {
    "reverse_text": "tasks.reverse_text:make_task",
    "gsm8k": "tasks.gsm8k:make_task",
    "countdown": "tasks.countdown:make_task",
    "reverse_turns": "tasks.reverse_turns:make_task",
    "gsm8k_calculator": "tasks.gsm8k_calculator:make_task",
    "prompt_file": "tasks.prompt_file:make_task",
}
KNOWN_TASKS = tuple(_TASKS)
# the tasks whose examples come from files (task.dataset applies)
FILE_TASKS = ("gsm8k", "gsm8k_calculator", "prompt_file")


def _has_dataset(dataset: DatasetConfig | None) -> bool:
    return dataset is not None and bool(dataset.path or dataset.eval_path or dataset.fields)


def _custom_task(path: str) -> Task:
    task = import_callable(path, "task")()
    if not isinstance(task, Task):
        raise TypeError(f"task import path={path!r} returned a {type(task).__name__}, not a tasks.Task")
    return dataclasses.replace(task, name=path)


def _checked_rewards(name: str, rewards: Sequence[Sequence[Any]]) -> tuple[tuple[str, float], ...]:
    out = []
    for term in rewards:
        ref, weight = term
        if not isinstance(ref, str) or not ref or not math.isfinite(float(weight)):
            raise ValueError(f"task {name!r}: reward term {term!r} must be (reward name or import path, finite weight)")
        out.append((ref, float(weight)))
    return tuple(out)


def get_task(name: str, task_cfg: TaskConfig | None = None) -> Task:
    """The task ``name``: registered, ``"verifiers:MODULE"``, or an import path of a no-argument
    function returning a :class:`Task` (renamed ``name``); ``task_cfg.code_paths`` join ``sys.path``
    first. When ``task_cfg.name == name``, its set ``system_prompt``, ``rewards`` and ``max_turns``
    replace the task's and ``dataset`` a file task's files.

    Raises:
        ValueError: unknown name, an unresolvable path, ``dataset`` for a task that reads no files,
            a malformed reward term, ``max_turns < 1``. TypeError: a custom function returned no Task.
    """
    if task_cfg is not None:
        add_import_paths(task_cfg.code_paths)  # busctl's own process; components have them on PYTHONPATH
    cfg = task_cfg if task_cfg is not None and task_cfg.name == name else None
    dataset = cfg.dataset if cfg is not None else None
    if name in _TASKS:
        if name not in FILE_TASKS and _has_dataset(dataset):
            raise ValueError(
                f"task {name!r} generates its examples and reads no files: remove task.dataset "
                f"(file tasks: {', '.join(FILE_TASKS)})"
            )
        make_task = import_callable(_TASKS[name], f"task {name!r}")
        task = make_task(dataset) if name in FILE_TASKS else make_task()
    elif name.startswith(VERIFIERS_PREFIX):
        if _has_dataset(dataset):
            raise ValueError(
                f"task {name!r} is a verifiers environment: it loads its own data, so task.dataset does not apply"
            )
        task = make_verifiers_task(name, cfg.verifiers_args if cfg is not None else {})
    elif ":" in name:
        task = _custom_task(name)
        if _has_dataset(dataset):
            raise ValueError(f"task {name!r} is a custom task: it loads its own data, so task.dataset does not apply")
    else:
        raise ValueError(
            f"unknown task={name!r}; known tasks: {', '.join(KNOWN_TASKS)}, or an import path 'package.module:function'"
        )
    rewards = task.rewards
    if cfg is not None and cfg.rewards:
        rewards = tuple((term.name, term.weight) for term in cfg.rewards)
    system_prompt = cfg.system_prompt if cfg is not None and cfg.system_prompt is not None else task.system_prompt
    max_turns = cfg.max_turns if cfg is not None and cfg.max_turns is not None else task.max_turns
    if max_turns < 1:
        raise ValueError(f"task {name!r}: max_turns={max_turns} must be >= 1")
    return dataclasses.replace(
        task, system_prompt=system_prompt, rewards=_checked_rewards(name, rewards), max_turns=max_turns
    )


def load_task_examples(task: str | Task, split: str, num_examples: int, seed: int) -> list[Example]:
    """At most ``num_examples`` examples ``{"id": str, "prompt": str, "info": dict}`` of ``split`` (a
    prefix independent of ``num_examples``). ValueError for a bad argument, file or example."""
    check_request(split, num_examples)
    if isinstance(task, str):
        task = get_task(task)
    examples = task.load(split, num_examples, seed)[:num_examples]
    for k, ex in enumerate(examples):
        if not (
            isinstance(ex, dict)
            and isinstance(ex.get("id"), str)
            and isinstance(ex.get("prompt"), str)
            and isinstance(ex.get("info"), dict)
        ):
            raise ValueError(
                f"task {task.name!r}: {split} example {k} must be {{'id': str, 'prompt': str, 'info': dict}}, "
                f"got {ex!r:.200}"
            )
    return examples


def eval_tasks(cfg: RunConfig) -> list[EvalTaskConfig]:
    """``cfg.eval.tasks``, else the training task; ``[]`` when eval is disabled."""
    if not cfg.eval.enabled:
        return []
    return list(cfg.eval.tasks) or [EvalTaskConfig(name=cfg.task.name)]


def reward_spec(cfg: RunConfig) -> dict[str, tuple[tuple[str, float], ...]]:
    """``{task name: ((reward ref, weight), ...)}`` for the training and every eval task. ValueError for
    an unknown task, or one without reward, environment or agent (unless ``skip_verification``)."""
    spec: dict[str, tuple[tuple[str, float], ...]] = {}
    for name in [cfg.task.name, *(t.name for t in eval_tasks(cfg))]:
        if name in spec:
            continue
        task = get_task(name, cfg.task)
        rewards = task.rewards
        if not rewards and task.env is None and task.agent is None and not cfg.filters.skip_verification:
            raise ValueError(f"task {name!r} has no reward function: set task.rewards (or filters.skip_verification)")
        spec[name] = rewards
    return spec


def task_agent(cfg: RunConfig) -> str | None:
    """``cfg.task.agent``, else the training task's own agent, else None; ValueError if both are set."""
    own = get_task(cfg.task.name, cfg.task).agent
    if cfg.task.agent and own:
        raise ValueError(f"task {cfg.task.name!r} runs its own agent ({own}): remove task.agent")
    return cfg.task.agent or own


def env_tasks(cfg: RunConfig) -> dict[str, Task]:
    """The run's training and eval tasks that have ``Task.env``, by name."""
    names = [cfg.task.name, *(t.name for t in eval_tasks(cfg))]
    tasks = {name: get_task(name, cfg.task) for name in dict.fromkeys(names)}
    return {name: task for name, task in tasks.items() if task.env is not None}
