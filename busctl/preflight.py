"""The checks ``busctl up`` runs before it spawns anything, shared with ``--dry-run``.

A config that validates can still name things a component would find missing only after the job started:
tasks, reward functions, environments, agents, advantage estimators. :func:`check_names` resolves each here, so
``up`` and ``up --dry-run`` refuse such a config with exit 2 and one message naming the key. Import paths are
imported (configs are trusted); registered reward names are only looked up. :func:`check_data` reads the rows of
the dataset files the same way (:mod:`tasks.data_check`), so a bad row is refused before the start too.
"""

from __future__ import annotations

import difflib

from configs.schema import ConfigError, RunConfig


def _nearest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_names(cfg: RunConfig) -> None:
    """Resolve every task, reward, environment, agent and advantage name of ``cfg``.

    Raises:
        ConfigError: the first name that does not resolve, naming its key, what is wrong and the
            nearest registered name.
    """
    from tasks.agent import resolve_agent_fn
    from tasks.env import env_refs, resolve_env_fn
    from tasks.import_path import import_callable
    from tasks.registry import KNOWN_TASKS, get_task, reward_spec, task_agent
    from tasks.rewards import get_reward_fn, known_reward_names, reward_name

    keyed = [("task.name", cfg.task.name)]
    keyed += [(f"eval.tasks[{i}].name", t.name) for i, t in enumerate(cfg.eval.tasks) if cfg.eval.enabled]
    tasks = {}
    for key, name in keyed:
        try:
            tasks[name] = get_task(name, cfg.task)
        except (ValueError, TypeError) as err:
            near = _nearest(name, list(KNOWN_TASKS)) if ":" not in name and name not in KNOWN_TASKS else ""
            raise ConfigError(f"{key}: {err}{near}") from None
    for name, task in tasks.items():
        key = "task.rewards" if cfg.task.rewards and name == cfg.task.name else f"the rewards of task {name!r}"
        for ref, _weight in task.rewards:
            try:
                get_reward_fn(ref) if ":" in ref else reward_name(ref)
            except ValueError as err:
                raise ConfigError(
                    f"{key}: {err}{_nearest(ref, known_reward_names()) if ':' not in ref else ''}"
                ) from None
        if task.env is not None:
            try:
                for ref in env_refs(task.env):
                    resolve_env_fn(ref)
            except ValueError as err:
                raise ConfigError(f"the environment of task {name!r}: {err}") from None
    try:
        reward_spec(cfg)  # a task with no reward function and no environment
        agent = task_agent(cfg)
        if agent:
            resolve_agent_fn(agent)
    except ValueError as err:
        raise ConfigError(f"task: {err}") from None
    if ":" in cfg.rewards.advantage:
        try:
            import_callable(cfg.rewards.advantage, "advantage")
        except ValueError as err:
            raise ConfigError(f"rewards.advantage: {err}") from None


def check_data(cfg: RunConfig) -> list[str]:
    """Check the rows of every dataset file the run reads (:mod:`tasks.data_check`): the training task's
    train split, each eval task's eval split, within :data:`tasks.data_check.BUDGET_S` for all of them.

    Returns:
        Notes for the console: where the check stopped at its budget (none when every row was checked).

    Raises:
        ConfigError: the first bad row, naming its file, line (or row) and field.
    """
    import time

    from tasks.data_check import BUDGET_S, check_task_data
    from tasks.registry import eval_tasks, get_task

    splits: dict[str, list[str]] = {} if cfg.eval.only else {cfg.task.name: ["train"]}
    for t in eval_tasks(cfg):
        splits.setdefault(t.name, []).append("eval")
    deadline = time.monotonic() + BUDGET_S
    notes = []
    for name, task_splits in splits.items():
        try:
            _, note = check_task_data(get_task(name, cfg.task), task_splits, deadline)
        except ValueError as err:
            raise ConfigError(f"task {name!r} data: {err}") from None
        if note:
            notes.append(f"task {name!r}: {note}")
    return notes
