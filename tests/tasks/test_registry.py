"""Tests for tasks.registry (the task registry) and tasks.datasets (local JSONL/Parquet files
with a field mapping): real files under tmp_path, the shipped GSM8K data, real configs."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs.schema import CONFIG_DIR, TaskConfig, load_config
from tasks import Task
from tasks.datasets import load_records
from tasks.gsm8k import DATA_DIR, GSM8K_SYSTEM_PROMPT
from tasks.registry import KNOWN_TASKS, eval_tasks, get_task, load_task_examples, reward_spec
from tasks.task import render_messages

GSM8K_TEST = DATA_DIR / "test.jsonl"
ROWS = [  # a user's GSM8K-like data with other column names
    {"problem": "What is 2 + 2?", "solution": "2 + 2 = 4\n#### 4", "source": "x"},
    {"problem": "What is 10 * 100?", "solution": "#### 1,000", "source": "y"},
    {"problem": "Half of 9?", "solution": "4.5", "source": "z"},  # a bare final answer
]
FIELDS = {"question": "problem", "answer": "solution"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gsm8k_cfg(**kwargs) -> TaskConfig:
    return TaskConfig.model_validate({"name": "gsm8k", **kwargs})


def custom_task() -> Task:
    """A custom task for the import-path test: two fixed examples, one custom reward."""
    examples = [{"id": f"c/{i}", "prompt": f"say {i}", "info": {"target": str(i)}} for i in range(2)]
    return Task("ignored", lambda split, n, seed: examples[:n], "be terse", (("my_pkg.rewards:exact", 1.0),))


def not_a_task() -> dict:
    return {}


def test_registry_and_unknown_name():
    assert set(KNOWN_TASKS) == {
        *("reverse_text", "gsm8k", "countdown", "reverse_turns", "gsm8k_calculator", "prompt_file")
    }
    with pytest.raises(ValueError, match="known tasks: reverse_text, gsm8k, countdown, reverse_turns"):
        get_task("nope")


def test_gsm8k_own_data_train_shuffled_by_seed_eval_in_file_order():
    first = json.loads(GSM8K_TEST.read_text().splitlines()[0])
    [ex] = load_task_examples("gsm8k", "eval", 1, seed=99)  # eval ignores the seed: the first N of test.jsonl
    assert ex == {
        "id": "gsm8k/eval/0",
        "prompt": first["question"],
        "info": {"answer": first["answer"].rpartition("####")[2].strip()},
    }
    train = load_task_examples("gsm8k", "train", 50, 0)
    assert train == load_task_examples("gsm8k", "train", 50, 0)
    assert train[:10] == load_task_examples("gsm8k", "train", 10, 0)  # a fixed permutation
    assert [e["id"] for e in train] != [e["id"] for e in load_task_examples("gsm8k", "train", 50, 1)]
    assert [e["id"] for e in train] != [f"gsm8k/train/{k}" for k in range(50)]  # shuffled
    everything = load_task_examples("gsm8k", "train", 10**6, 0)  # at most the file
    assert len(everything) == 7473 and len({e["id"] for e in everything}) == 7473
    assert all(e["info"]["answer"] and "," not in e["info"]["answer"] for e in everything)


def test_gsm8k_defaults_and_overrides():
    task = get_task("gsm8k")
    assert task.system_prompt == GSM8K_SYSTEM_PROMPT and "####" in task.system_prompt
    assert task.rewards == (("gsm8k", 1.0),)
    cfg = gsm8k_cfg(system_prompt="Be brief.", rewards=[{"name": "gsm8k"}, {"name": "my_pkg.r:brevity", "weight": 0.1}])
    task = get_task("gsm8k", cfg)
    assert task.system_prompt == "Be brief." and task.rewards == (("gsm8k", 1.0), ("my_pkg.r:brevity", 0.1))
    ex = task.load("eval", 1, 0)[0]
    assert render_messages(ex, task.system_prompt) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ex["prompt"]},
    ]
    # the overrides belong to the task they name: another task keeps its own
    assert get_task("reverse_text", cfg).system_prompt is None
    assert get_task("reverse_text", cfg).rewards == (("reverse_text", 1.0),)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_user_dataset_with_field_mapping(tmp_path, suffix):
    path = tmp_path / f"mine.{suffix}"
    if suffix == "jsonl":
        write_jsonl(path, ROWS)
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    task = get_task("gsm8k", gsm8k_cfg(dataset={"path": str(path), "eval_path": str(path), "fields": FIELDS}))
    got = task.load("eval", 10, 0)
    assert got == [  # the unmapped column "source" reaches the reward functions, as TRL passes it
        {"id": "gsm8k/eval/0", "prompt": "What is 2 + 2?", "info": {"answer": "4", "source": "x"}},
        {"id": "gsm8k/eval/1", "prompt": "What is 10 * 100?", "info": {"answer": "1000", "source": "y"}},
        {"id": "gsm8k/eval/2", "prompt": "Half of 9?", "info": {"answer": "4.5", "source": "z"}},
    ]
    assert sorted(e["id"] for e in task.load("train", 10, 0)) == [e["id"].replace("eval", "train") for e in got]


def test_user_train_file_keeps_the_tasks_own_eval(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    task = get_task("gsm8k", gsm8k_cfg(dataset={"path": str(path), "fields": FIELDS}))
    assert {e["prompt"] for e in task.load("train", 10, 0)} == {r["problem"] for r in ROWS}
    assert task.load("eval", 1, 0) == load_task_examples("gsm8k", "eval", 1, 0)


def test_missing_field_names_file_line_and_column(tmp_path):
    rows = [ROWS[0], ROWS[1], {"problem": "no solution here"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:line 3: missing field 'answer' \(mapped from column 'solution'\)"
    ):
        get_task("gsm8k", gsm8k_cfg(dataset={"path": str(path), "fields": FIELDS})).load("train", 5, 0)
    table = pa.Table.from_pylist([{"problem": "q", "answer": "#### 1"}])
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(
        ValueError, match=r"bad\.parquet: missing field 'answer' \(mapped from column 'solution'\).*'problem', 'answer'"
    ):
        load_records(tmp_path / "bad.parquet", ["question", "answer"], fields=FIELDS)
    null = pa.Table.from_pylist([{"question": "q", "answer": "#### 1"}, {"question": None, "answer": "#### 2"}])
    pq.write_table(null, tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet:row 2: missing field 'question'"):
        load_records(tmp_path / "null.parquet", ["question", "answer"])


@pytest.mark.parametrize(
    "content, error",
    [
        ('{"question": "q", "answer": "#### 1"}\nnot json\n', r"line 2: not valid JSON"),
        ('["q", "#### 1"]\n', r"line 1: expected a JSON object, got list"),
        ("\n\n", r"has no rows"),
    ],
)
def test_malformed_jsonl(tmp_path, content, error):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=error):
        load_records(tmp_path / "d.jsonl", ["question", "answer"])


def test_bad_answer_names_the_record(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "line one\nline two, no final answer"}])
    with pytest.raises(ValueError, match=r"d\.jsonl: record 1: .*####"):
        get_task("gsm8k", gsm8k_cfg(dataset={"path": str(path)})).load("train", 1, 0)


def test_dataset_paths_are_local_files_only(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*") as err:
        load_records(tmp_path / "missing.jsonl", ["question"])
    assert "missing.jsonl" in str(err.value)
    with pytest.raises(ValueError, match="only local files"):
        load_records("hf://datasets/openai/gsm8k/main/train.parquet", ["question"])
    (tmp_path / "d.csv").write_text("question\nq\n")
    with pytest.raises(ValueError, match=r"suffix '\.csv'"):
        load_records(tmp_path / "d.csv", ["question"])
    write_jsonl(tmp_path / "d.txt", [{"question": "q"}])
    assert load_records(tmp_path / "d.txt", ["question"], format="jsonl") == [{"question": "q"}]


def test_dataset_config_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="'questoin', which the task does not use"):
        get_task("gsm8k", gsm8k_cfg(dataset={"path": str(path), "fields": {"questoin": "problem"}})).load("train", 1, 0)
    with pytest.raises(ValueError, match="fields is set but neither"):
        get_task("gsm8k", gsm8k_cfg(dataset={"fields": FIELDS}))
    with pytest.raises(ValueError, match="reads no files.*gsm8k"):
        get_task("reverse_text", TaskConfig.model_validate({"name": "reverse_text", "dataset": {"path": str(path)}}))


def test_custom_task_by_import_path():
    path = f"{__name__}:custom_task"
    task = get_task(path)
    assert task.name == path  # the name groups carry, so reward workers find its rewards
    assert task.system_prompt == "be terse" and task.rewards == (("my_pkg.rewards:exact", 1.0),)
    assert load_task_examples(path, "train", 1, 0) == [{"id": "c/0", "prompt": "say 0", "info": {"target": "0"}}]
    cfg = TaskConfig.model_validate({"name": path, "rewards": [{"name": "reverse_text", "weight": 2.0}]})
    assert get_task(path, cfg).rewards == (("reverse_text", 2.0),)
    with pytest.raises(TypeError, match="not a tasks.Task"):
        get_task(f"{__name__}:not_a_task")
    with pytest.raises(ValueError, match="task import path"):
        get_task(f"{__name__}:no_such_function")


def test_malformed_examples_of_a_custom_loader_are_refused():
    task = Task("broken", lambda split, n, seed: [{"id": 1, "prompt": "p", "info": {}}])
    with pytest.raises(ValueError, match="'broken': train example 0"):
        load_task_examples(task, "train", 1, 0)


@pytest.mark.parametrize("task", ["reverse_text", "countdown"])
def test_synthetic_tasks_are_deterministic_and_split(task):
    train = load_task_examples(task, "train", 20, 0)
    assert train == load_task_examples(task, "train", 20, 0) and len(train) == 20
    eval_ = load_task_examples(task, "eval", 20, 1234)
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in eval_}
    assert all(set(e) == {"id", "prompt", "info"} and json.loads(json.dumps(e)) == e for e in train + eval_)


def test_countdown_task():
    task = get_task("countdown")
    assert task.rewards == (("countdown", 1.0),) and task.system_prompt is None  # the prompt states the format
    [ex] = task.load("train", 1, 0)
    assert isinstance(ex["info"]["target"], int) and all(isinstance(n, int) for n in ex["info"]["numbers"])


def test_reward_spec_covers_training_and_eval_tasks():
    cfg = load_config(CONFIG_DIR / "gsm8k.yaml")
    assert reward_spec(cfg) == {"gsm8k": (("gsm8k", 1.0),)}
    cfg = load_config(
        CONFIG_DIR / "gsm8k.yaml",
        [
            "task.rewards=[{name: gsm8k}, {name: 'my_pkg.r:brevity', weight: 0.1}]",
            "eval.tasks=[{name: gsm8k}, {name: countdown}, {name: reverse_text}]",
        ],
    )
    assert reward_spec(cfg) == {
        "gsm8k": (("gsm8k", 1.0), ("my_pkg.r:brevity", 0.1)),  # the eval task of the training task shares its rewards
        "countdown": (("countdown", 1.0),),
        "reverse_text": (("reverse_text", 1.0),),
    }
    assert [t.name for t in eval_tasks(cfg)] == ["gsm8k", "countdown", "reverse_text"]
    cfg = load_config(CONFIG_DIR / "countdown.yaml", ["eval.enabled=false"])
    assert reward_spec(cfg) == {"countdown": (("countdown", 1.0),)} and eval_tasks(cfg) == []
    cfg = load_config(overrides=["eval.tasks=[]"])  # no eval tasks: the training task with the defaults
    assert [(t.name, t.num_examples) for t in eval_tasks(cfg)] == [("reverse_text", 128)]


def test_shipped_task_configs_load():
    for name in ("gsm8k", "countdown", "gsm8k_calculator"):
        cfg = load_config(CONFIG_DIR / f"{name}.yaml")
        assert cfg.task.name == name and cfg.model.path == ""
        assert cfg.packer.micro_batch_tokens >= cfg.model.max_model_len
        task = get_task(name, cfg.task)
        for t in eval_tasks(cfg):
            assert len(load_task_examples(task, "eval", t.num_examples, t.seed)) == t.num_examples
