"""The ``prompt_file`` task: your own single-turn data, scored by your own reward functions.

Each row of ``task.dataset.path`` (JSONL or Parquet) is one prompt: its ``prompt`` column (another
through ``task.dataset.fields: {prompt: COLUMN}``) is the user message, and every other column goes
to ``info`` as it is, so a reward function reads it (a TRL-style one as a keyword argument, e.g.
``ground_truth``). The task has no reward of its own: ``task.rewards`` names them. Its eval split is
``task.dataset.eval_path``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from tasks.datasets import DataFile, file_task_loader
from tasks.task import Example, Task, check_request

if TYPE_CHECKING:
    from configs.rollout import DatasetConfig

NAME = "prompt_file"


def prompt_example(record: dict[str, Any], example_id: str) -> Example:
    """An example from a row: ``prompt`` the user message (``info`` gets the other columns). ValueError
    for a prompt that is not a non-empty string."""
    prompt = record["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"field 'prompt' must be a non-empty string, got {prompt!r:.80}")
    return {"id": example_id, "prompt": prompt, "info": {}}


def _no_eval_file(split: str, num_examples: int, seed: int) -> list[Example]:
    raise ValueError(
        f"task {NAME!r}: the eval split needs task.dataset.eval_path (a file of held-out prompts), "
        "or set eval.enabled: false"
    )


def make_task(dataset: DatasetConfig | None = None) -> Task:
    """The registered ``prompt_file`` task over ``dataset``'s files (no system prompt, no reward).
    ValueError when ``dataset.path`` is empty."""
    if dataset is None or not dataset.path:
        raise ValueError(
            f"task {NAME!r} reads your file: set task.dataset.path (a JSONL or Parquet file with a 'prompt' column, "
            "or task.dataset.fields: {prompt: COLUMN})"
        )
    mine = {"fields": dataset.fields or None, "format": dataset.format}
    files = {"train": DataFile(dataset.path, **mine), "eval": DataFile(dataset.eval_path or dataset.path, **mine)}
    load = file_task_loader(NAME, files, required=("prompt",), make_example=prompt_example)
    if dataset.eval_path:
        return Task(NAME, load)

    @functools.wraps(load)  # keeps load.data_source (tasks.data_check)
    def train_only(split: str, num_examples: int, seed: int) -> list[Example]:
        check_request(split, num_examples)
        return (load if split == "train" else _no_eval_file)(split, num_examples, seed)

    return Task(NAME, train_only)
