"""The task registry: task names, the custom-task hook, eval tasks and the reward spec.

Registered tasks (``KNOWN_TASKS``), one module each (dataset, prompts, rewards, eval split):

- ``reverse_text`` (the default job, :mod:`tasks.reverse_text`): reverse a random string;
- ``gsm8k`` (:mod:`tasks.gsm8k`): grade-school math word problems from ``tasks/data/gsm8k/``;
- ``countdown`` (:mod:`tasks.countdown`): reach a target with given numbers and + - * /;
- ``reverse_turns`` (:mod:`tasks.reverse_turns`): multi-turn, reverse each string an environment gives;
- ``gsm8k_calculator`` (:mod:`tasks.gsm8k_calculator`): multi-turn GSM8K with a calculator tool.

A task named ``"verifiers:MODULE"`` is a verifiers environment (:mod:`tasks.verifiers_env`,
``task.verifiers_args`` its ``load_environment`` arguments): an agent task whose reward is the
environment's rubric. A task given as an import path ``"package.module:function"`` is any function returning a
:class:`tasks.task.Task` (it runs the code it names: configs are trusted). Registered tasks are
stored as import paths too and imported on first use, so a process that runs only
``reverse_text`` never imports math-verify.

Config (``task`` section, :class:`configs.schema.TaskConfig`): ``get_task(name, task_cfg)`` applies
``task_cfg``'s ``system_prompt`` (if set), ``rewards`` (if any) and, for a file task, ``dataset``
(own local JSONL/Parquet files with a field mapping, see :mod:`tasks.datasets`) whenever
``task_cfg.name == name``, so the eval task of the training task gets them too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from configs.rollout import DatasetConfig, EvalTaskConfig, TaskConfig
from configs.schema import RunConfig
from tasks.import_path import import_callable
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
}
KNOWN_TASKS = tuple(_TASKS)
FILE_TASKS = ("gsm8k", "gsm8k_calculator")  # the tasks whose examples come from files (task.dataset applies)


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
    """The task registered as ``name``, or the one an import path ``"package.module:function"`` returns.

    Args:
        name: a name of ``KNOWN_TASKS`` or an import path (the function is called with no
            arguments and must return a :class:`Task`; its ``name`` becomes ``name``).
        task_cfg: the run's ``task`` section; applied only when ``task_cfg.name == name``: its
            ``system_prompt`` (when not None), ``rewards`` (when not empty) and ``max_turns`` (when
            not None) replace the task's, and its ``dataset`` replaces a file task's files.

    Raises:
        ValueError: unknown name (listing the known ones), an import path that does not resolve,
            ``task_cfg.dataset`` set for a task that reads no files, a malformed reward term, or
            ``max_turns < 1``.
        TypeError: an import path whose function does not return a :class:`Task`.
    """
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
    """Return ``num_examples`` (at most, for file tasks) examples of ``task``'s ``split``.

    Args:
        task: a :class:`Task`, or a name / import path for :func:`get_task` (without config).
        split: ``"train"`` or ``"eval"``; the splits never share a prompt, whatever the seeds.
        num_examples: how many (>= 0). The first ``n`` examples for a seed do not depend on
            ``num_examples``.
        seed: any int (train order, and synthetic tasks' draws).

    Returns:
        A list of ``{"id": str, "prompt": str, "info": dict}``.

    Raises:
        ValueError: naming ``task``, ``split`` or ``num_examples`` when it is invalid, a file that
            cannot be read (see :mod:`tasks.datasets`), or a loader returning a malformed example.
    """
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
                f"task {task.name!r}: {split} example {k} must be {{'id': str, 'prompt': str, 'info': dict}}, got {ex!r:.200}"
            )
    return examples


def eval_tasks(cfg: RunConfig) -> list[EvalTaskConfig]:
    """The run's eval tasks: ``cfg.eval.tasks``, or the training task with the defaults when it is
    empty; ``[]`` when ``cfg.eval.enabled`` is False."""
    if not cfg.eval.enabled:
        return []
    return list(cfg.eval.tasks) or [EvalTaskConfig(name=cfg.task.name)]


def reward_spec(cfg: RunConfig) -> dict[str, tuple[tuple[str, float], ...]]:
    """What a reward worker must be able to score: ``{task name: ((reward ref, weight), ...)}`` for
    the training task and every eval task (each via :func:`get_task` with ``cfg.task``).

    Raises:
        ValueError: a task is unknown, or has neither a reward function nor an environment while
            ``filters.skip_verification`` is off.
    """
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
    """The agent function of the run's training task: ``cfg.task.agent``, else the task's own
    (:attr:`Task.agent`, a verifiers task's), else None.

    Raises:
        ValueError: ``cfg.task.agent`` is set for a task that has its own agent.
    """
    own = get_task(cfg.task.name, cfg.task).agent
    if cfg.task.agent and own:
        raise ValueError(f"task {cfg.task.name!r} runs its own agent ({own}): remove task.agent")
    return cfg.task.agent or own


def env_tasks(cfg: RunConfig) -> dict[str, Task]:
    """The multi-turn tasks of the run (training and eval tasks with ``Task.env``), by name: what
    a producer runs environments for (:class:`tasks.env.EnvCalls`)."""
    names = [cfg.task.name, *(t.name for t in eval_tasks(cfg))]
    tasks = {name: get_task(name, cfg.task) for name in dict.fromkeys(names)}
    return {name: task for name, task in tasks.items() if task.env is not None}
