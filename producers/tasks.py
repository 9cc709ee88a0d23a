"""The task registry: what a task's prompts are, how they are rendered, and which rewards score them.

A :class:`Task` names a loader of examples (one split at a time), an optional system prompt and its
weighted reward functions. A task example is a plain, JSON-able dict::

    {"id": str, "prompt": str (the user message text), "info": dict}

``info`` travels with the prompt through the bus to the reward workers, which call each of the
task's reward functions ``fn(completion, info) -> float`` (see :mod:`rewards.registry`) and add
them up with their weights. ``render_messages`` turns an example into chat messages for the
policy's chat template (the producer applies the template).

Tasks (``KNOWN_TASKS``); a task given as an import path ``"package.module:function"`` is any
function returning a :class:`Task` (it runs the code it names: configs are trusted):

- ``reverse_text`` (the default job): the prompt is a string of 5-12 random lowercase letters;
  the answer is that string reversed, e.g. ``"hello"`` -> ``"olleh"``. Train and eval are
  disjoint *by construction*, whatever their seeds: a string belongs to the eval split iff the
  first byte of ``sha256(string)`` is below ``EVAL_BUCKET_BYTES`` (1/16 of all strings), and a
  split keeps only its own strings (and no duplicates). No system prompt.
- ``gsm8k``: grade-school math word problems from ``producers/data/gsm8k/`` (train: ``train.jsonl``,
  eval: ``test.jsonl``); prompt = ``question``, ``info = {"answer": the text after "####" of the
  worked ``answer``}``, scored by ``rewards.gsm8k`` (value comparison with math-verify).
- ``countdown``: reach a target with given numbers and + - * / (``producers.countdown``; train and
  eval disjoint by construction; the prompt states the rules and the answer format, so no system
  prompt), scored by ``rewards.countdown``.

Splits and order: ``"train"`` of a file task is the file shuffled by ``seed`` (a fixed permutation:
the first ``n`` examples do not depend on ``num_examples``); ``"eval"`` is the first
``num_examples`` of the eval file in file order (``seed`` unused). Synthetic tasks draw both splits
from their own seeded generators. Example ids are ``"{task}/{split}/{k}"`` (for file tasks ``k`` is
the row in the file, so an id names the same problem whatever the seed).

Config (``task`` section, :class:`configs.schema.TaskConfig`): ``get_task(name, task_cfg)`` applies
``task_cfg``'s ``system_prompt`` (if set), ``rewards`` (if any) and, for a file task, ``dataset``
(own local JSONL/Parquet files with a field mapping, see :mod:`producers.datasets`) whenever
``task_cfg.name == name``, so the eval task of the training task gets them too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from configs.rollout import DatasetConfig, EvalTaskConfig, TaskConfig
from configs.schema import RunConfig
from producers.datasets import load_records
from rewards.registry import import_callable

KNOWN_SPLITS = ("train", "eval")
DEFAULT_TASK = "reverse_text"
DATA_DIR = Path(__file__).resolve().parent / "data"

# reverse_text distribution: lengths uniform in [MIN_LEN, MAX_LEN], letters uniform in a-z.
REVERSE_TEXT_MIN_LEN = 5
REVERSE_TEXT_MAX_LEN = 12
REVERSE_TEXT_ALPHABET = string.ascii_lowercase
# First sha256 byte < 16 -> eval split (1/16 of the string space).
EVAL_BUCKET_BYTES = 16

GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then give the final answer as a number "
    "on the last line in the form: #### <number>"
)

Example = dict[str, Any]
Loader = Callable[[str, int, int], list[Example]]


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its examples, prompt rendering and reward functions.

    Fields:
        name: the name prompts and groups carry (``Prompt.task``): the registered name, or the
            import path for a custom task.
        load: ``(split "train"|"eval", num_examples, seed) -> [example]``, deterministic in its
            arguments (see :func:`load_task_examples`).
        system_prompt: the system message before every prompt, or None for none.
        rewards: ``((reward ref, weight), ...)``: registered reward names or import paths
            ``"package.module:function"``; reward = sum of weight * score.
    """

    name: str
    load: Loader
    system_prompt: str | None = None
    rewards: tuple[tuple[str, float], ...] = ()


def _check_request(split: str, num_examples: int) -> None:
    if split not in KNOWN_SPLITS:
        raise ValueError(f"unknown split={split!r}; known splits: {', '.join(KNOWN_SPLITS)}")
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")


def _has_dataset(dataset: DatasetConfig | None) -> bool:
    return dataset is not None and bool(dataset.path or dataset.eval_path or dataset.fields)


# --- reverse_text -----------------------------------------------------------------------------


def split_of(text: str) -> str:
    """The split (``"train"`` or ``"eval"``) that owns ``text``, fixed by its sha256."""
    return "eval" if hashlib.sha256(text.encode()).digest()[0] < EVAL_BUCKET_BYTES else "train"


def _reverse_text_examples(split: str, num_examples: int, seed: int) -> list[Example]:
    _check_request(split, num_examples)
    # A distinct stream per split, so "train" and "eval" with the same seed do not share a prefix.
    rng = random.Random(f"reverse_text/{split}/{seed}")
    seen: set[str] = set()
    examples: list[Example] = []
    while len(examples) < num_examples:
        length = rng.randint(REVERSE_TEXT_MIN_LEN, REVERSE_TEXT_MAX_LEN)
        text = "".join(rng.choice(REVERSE_TEXT_ALPHABET) for _ in range(length))
        if text in seen or split_of(text) != split:
            continue
        seen.add(text)
        examples.append(
            {
                "id": f"reverse_text/{split}/{seed}/{len(examples)}",
                "prompt": text,
                "info": {"target": text[::-1]},
            }
        )
    return examples


# --- file tasks -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One split's local file: ``path`` (JSONL or Parquet), its ``fields`` mapping
    ``{task field: column}`` (None: same names) and ``format`` (see :mod:`producers.datasets`)."""

    path: str | Path
    fields: Mapping[str, str] | None = None
    format: str = "auto"


def file_task_loader(
    task_name: str,
    files: Mapping[str, DataFile],
    *,
    required: Sequence[str],
    make_example: Callable[[dict[str, Any], str], Example],
) -> Loader:
    """A task loader over local files, one per split (for built-in and custom file tasks).

    Args:
        task_name: prefix of the example ids ``"{task_name}/{split}/{row}"`` and of the shuffle seed.
        files: ``{"train": DataFile, "eval": DataFile}`` (read on each call).
        required: the task's fields each row must have (see :func:`producers.datasets.load_records`).
        make_example: ``(record {field: value}, example id) -> example``; a ``ValueError`` or
            ``TypeError`` it raises is re-raised naming the file and record.

    Returns:
        ``load(split, num_examples, seed)``: train = the rows shuffled by ``seed``, eval = the
        rows in file order; at most ``num_examples`` of them.

    Raises:
        ValueError: ``files`` lacks a split.
    """
    missing = [split for split in KNOWN_SPLITS if split not in files]
    if missing:
        raise ValueError(f"task {task_name!r}: no file for split(s) {', '.join(missing)}")

    def load(split: str, num_examples: int, seed: int) -> list[Example]:
        _check_request(split, num_examples)
        file = files[split]
        records = load_records(file.path, required, fields=file.fields, format=file.format)
        order = list(range(len(records)))
        if split == "train":
            random.Random(f"{task_name}/train/{seed}").shuffle(order)
        examples = []
        for k in order[:num_examples]:
            try:
                examples.append(make_example(records[k], f"{task_name}/{split}/{k}"))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{file.path}: record {k + 1}: {exc}") from exc
        return examples

    return load


def _gsm8k_example(record: dict[str, Any], example_id: str) -> Example:
    """``question`` is the prompt; ``answer`` is a worked solution ending in ``#### <final answer>``
    (GSM8K's own format) or, for a user's dataset, the final answer alone on one line."""
    from rewards.gsm8k import gsm8k_final_answer  # math-verify: imported only when gsm8k is used

    answer = str(record["answer"]).strip()
    bare = "####" not in answer and "\n" not in answer
    final = gsm8k_final_answer(f"#### {answer}" if bare else answer)
    if not final:
        raise ValueError(f"empty final answer in {answer[-80:]!r}")
    return {"id": example_id, "prompt": str(record["question"]), "info": {"answer": final}}


def _file_task(
    name: str,
    dataset: DatasetConfig | None,
    default_dir: Path,
    required: Sequence[str],
    make_example: Callable[[dict[str, Any], str], Example],
    **task_fields: Any,
) -> Task:
    """A file task over ``default_dir/{train,test}.jsonl``, or the user's ``dataset`` files where
    given (``dataset.fields`` and ``format`` apply to the user's files only)."""
    dataset = dataset or DatasetConfig()
    if dataset.fields and not (dataset.path or dataset.eval_path):
        raise ValueError(f"task {name!r}: task.dataset.fields is set but neither task.dataset.path nor eval_path; the mapping applies to your files")
    mine = {"fields": dataset.fields or None, "format": dataset.format}
    files = {
        "train": DataFile(dataset.path, **mine) if dataset.path else DataFile(default_dir / "train.jsonl"),
        "eval": DataFile(dataset.eval_path, **mine) if dataset.eval_path else DataFile(default_dir / "test.jsonl"),
    }
    return Task(name, file_task_loader(name, files, required=required, make_example=make_example), **task_fields)


# --- the registry -----------------------------------------------------------------------------


def _no_dataset(name: str, dataset: DatasetConfig | None) -> None:
    if _has_dataset(dataset):
        raise ValueError(
            f"task {name!r} generates its examples and reads no files: remove task.dataset "
            f"(file tasks: {', '.join(FILE_TASKS)})"
        )


def _reverse_text_task(dataset: DatasetConfig | None) -> Task:
    _no_dataset("reverse_text", dataset)
    return Task("reverse_text", _reverse_text_examples, None, (("reverse_text", 1.0),))


def _gsm8k_task(dataset: DatasetConfig | None) -> Task:
    return _file_task("gsm8k", dataset, DATA_DIR / "gsm8k", ("question", "answer"), _gsm8k_example,
                      system_prompt=GSM8K_SYSTEM_PROMPT, rewards=(("gsm8k", 1.0),))


def _countdown_examples(split: str, num_examples: int, seed: int) -> list[Example]:
    from producers.countdown import countdown_examples

    _check_request(split, num_examples)
    return countdown_examples(split, num_examples, seed)


def _countdown_task(dataset: DatasetConfig | None) -> Task:
    _no_dataset("countdown", dataset)
    # No system prompt: the user prompt already states the rules and the <answer></answer> format.
    return Task("countdown", _countdown_examples, None, (("countdown", 1.0),))


_TASKS: dict[str, Callable[[DatasetConfig | None], Task]] = {
    "reverse_text": _reverse_text_task,
    "gsm8k": _gsm8k_task,
    "countdown": _countdown_task,
}
KNOWN_TASKS = tuple(_TASKS)
FILE_TASKS = ("gsm8k",)  # the tasks whose examples come from files (task.dataset applies)


def _custom_task(path: str) -> Task:
    task = import_callable(path, "task")()
    if not isinstance(task, Task):
        raise TypeError(f"task import path={path!r} returned a {type(task).__name__}, not a producers.tasks.Task")
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
            ``system_prompt`` (when not None) and ``rewards`` (when not empty) replace the task's,
            and its ``dataset`` replaces a file task's files.

    Raises:
        ValueError: unknown name (listing the known ones), an import path that does not resolve,
            ``task_cfg.dataset`` set for a task that reads no files, or a malformed reward term.
        TypeError: an import path whose function does not return a :class:`Task`.
    """
    cfg = task_cfg if task_cfg is not None and task_cfg.name == name else None
    dataset = cfg.dataset if cfg is not None else None
    if name in _TASKS:
        task = _TASKS[name](dataset)
    elif ":" in name:
        task = _custom_task(name)
        if _has_dataset(dataset):
            raise ValueError(f"task {name!r} is a custom task: it loads its own data, so task.dataset does not apply")
    else:
        raise ValueError(f"unknown task={name!r}; known tasks: {', '.join(KNOWN_TASKS)}, or an import path 'package.module:function'")
    rewards = task.rewards
    if cfg is not None and cfg.rewards:
        rewards = tuple((term.name, term.weight) for term in cfg.rewards)
    system_prompt = cfg.system_prompt if cfg is not None and cfg.system_prompt is not None else task.system_prompt
    return dataclasses.replace(task, system_prompt=system_prompt, rewards=_checked_rewards(name, rewards))


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
            cannot be read (see :mod:`producers.datasets`), or a loader returning a malformed example.
    """
    _check_request(split, num_examples)
    if isinstance(task, str):
        task = get_task(task)
    examples = task.load(split, num_examples, seed)[:num_examples]
    for k, ex in enumerate(examples):
        if not (isinstance(ex, dict) and isinstance(ex.get("id"), str) and isinstance(ex.get("prompt"), str)
                and isinstance(ex.get("info"), dict)):
            raise ValueError(f"task {task.name!r}: {split} example {k} must be {{'id': str, 'prompt': str, 'info': dict}}, got {ex!r:.200}")
    return examples


def render_messages(example: Example, system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages for one example: an optional system turn (the task's ``system_prompt``), then
    the user turn.

    reverse_text uses no system prompt: the tiny policy learns the task from the data, and every
    prompt token costs compute on 2 CPU cores.
    """
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": example["prompt"]})
    return messages


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
        ValueError: a task is unknown, or has no reward function while
            ``filters.skip_verification`` is off.
    """
    spec: dict[str, tuple[tuple[str, float], ...]] = {}
    for name in [cfg.task.name, *(t.name for t in eval_tasks(cfg))]:
        if name in spec:
            continue
        rewards = get_task(name, cfg.task).rewards
        if not rewards and not cfg.filters.skip_verification:
            raise ValueError(f"task {name!r} has no reward function: set task.rewards (or filters.skip_verification)")
        spec[name] = rewards
    return spec
