"""Custom data and rewards: a dataset's columns reach reward functions as TRL passes them, the ``prompt_file``
task, and ``task.code_paths`` (checked, relative to the config file, on the import path of reward children)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from configs.schema import ConfigError, load_config
from rewards.scorers import IsolatedScorer
from tasks.registry import get_task, load_task_examples
from tasks.trl_rewards import trl_batch

REWARDS = """
def reward(completions, ground_truth, **kwargs):  # TRL's documented signature
    return [1.0 if c.strip() == gt else 0.0 for c, gt in zip(completions, ground_truth)]


def difficulty(completion, info):  # rlbus's own signature: the same columns in info
    return float(info["difficulty"])
"""


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """``tmp_path/my_code/col_rewards.py``, ``tmp_path/data/{train,test}.jsonl`` (TRL-style columns)."""
    (tmp_path / "my_code").mkdir()
    (tmp_path / "my_code" / "col_rewards.py").write_text(REWARDS)
    (tmp_path / "data").mkdir()
    rows = [
        {"problem": f"What is {k} + {k}?", "solution": f"{k} + {k} = {2 * k}\n#### {2 * k}", "ground_truth": str(2 * k)}
        for k in range(1, 4)
    ]
    for r, d in zip(rows, (1, 2, 3)):
        r["difficulty"] = d
    _write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    _write_jsonl(tmp_path / "data" / "test.jsonl", rows[:1])
    return tmp_path


def test_every_column_reaches_a_trl_function_and_an_rlbus_function(project: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # get_task appends task.code_paths
    config = project / "run.yaml"
    config.write_text(
        "task:\n"
        "  name: prompt_file\n"
        "  code_paths: [my_code]\n"  # relative to this file's folder
        "  dataset: {path: %s, eval_path: %s, fields: {prompt: problem}}\n"
        "  rewards: [{name: 'trl:col_rewards:reward'}, {name: 'col_rewards:difficulty'}]\n"
        % (project / "data" / "train.jsonl", project / "data" / "test.jsonl")
    )
    monkeypatch.chdir(project / "data")  # not the config's folder
    cfg = load_config(config)
    assert cfg.task.code_paths == [str(project / "my_code")]
    task = get_task("prompt_file", cfg.task)
    [example] = [e for e in load_task_examples(task, "train", 3, 0) if e["prompt"] == "What is 2 + 2?"]
    # the mapped column is the prompt; the others pass as they are
    assert example["info"] == {"solution": "2 + 2 = 4\n#### 4", "ground_truth": "4", "difficulty": 2}
    refs = [ref for ref, _ in task.rewards]
    completions = ["4", " 4 ", "5"]
    batch = trl_batch(example["prompt"], completions, [[1], [2], [3]], global_step=0, max_steps=1)
    with IsolatedScorer(refs, num_procs=1) as scorer:  # children: the worker's sys.path, code_paths included
        trl, own = scorer.score(completions, example["info"], batch=batch)
    assert trl.rewards == [1.0, 1.0, 0.0] and trl.errors == [None] * 3
    assert own.rewards == [2.0] * 3 and own.errors == [None] * 3


def test_prompt_file_task_reads_a_prompt_column_and_passes_the_rest(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": "abc", "ground_truth": "cba", "when": None}])
    cfg = load_config(
        None, ["task.name=prompt_file", f"task.dataset.path={data}", "task.dataset.fields={prompt: text}"]
    )
    task = get_task("prompt_file", cfg.task)
    assert task.rewards == () and task.system_prompt is None
    assert load_task_examples(task, "train", 5, 0) == [
        {"id": "prompt_file/train/0", "prompt": "abc", "info": {"ground_truth": "cba", "when": None}}
    ]
    with pytest.raises(ValueError, match="the eval split needs task.dataset.eval_path"):
        load_task_examples(task, "eval", 1, 0)
    # Parquet: every column read, a value JSON cannot carry (a timestamp) left out
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"prompt": "abc", "tags": ["x", "y"], "at": datetime.datetime(2026, 1, 1)}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    cfg = load_config(None, ["task.name=prompt_file", f"task.dataset.path={tmp_path / 'd.parquet'}"])
    assert load_task_examples(get_task("prompt_file", cfg.task), "train", 1, 0)[0]["info"] == {"tags": ["x", "y"]}
    with pytest.raises(ValueError, match="set task.dataset.path"):
        get_task("prompt_file", load_config(None, ["task.name=prompt_file"]).task)


def test_code_paths_are_checked(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "mine").mkdir()
    config = tmp_path / "cfg" / "c.yaml"
    config.write_text("task: {code_paths: [mine, nowhere]}\n")
    with pytest.raises(ConfigError, match=r"task.code_paths\[1\]: 'nowhere' is not a folder .*relative paths start at"):
        load_config(config)
    monkeypatch.chdir(tmp_path)  # an override's relative path starts at the working directory
    assert load_config(config, ["task.code_paths=[cfg/mine]"]).task.code_paths == [str(tmp_path / "cfg" / "mine")]
    (tmp_path / "cfg" / "mine" / "rewards.py").write_text("")  # rlbus's rewards package comes first on the path
    with pytest.raises(ConfigError, match=r"holds the module 'rewards', which is imported from .*; rename it"):
        load_config(config, ["task.code_paths=[cfg/mine]"])
