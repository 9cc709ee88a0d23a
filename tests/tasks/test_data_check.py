"""Dataset files checked before the start (:mod:`tasks.data_check`, run by ``busctl up`` and ``--dry-run``):
every row streamed, each bad one named by file, line (or Parquet row) and field; a time budget with a note."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from busctl import cli as busctl
from configs.rollout import DatasetConfig
from tasks.data_check import check_task_data
from tasks.gsm8k import make_task

GOOD = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}


def jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def check(path: Path, **dataset) -> tuple[int, str]:
    task = make_task(DatasetConfig(path=str(path), **dataset))
    return check_task_data(task, ["train"], time.monotonic() + 60)


@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"answer": "2"}, ":line 4: missing field 'question'; present: 'answer'"),
        ({"question": 7, "answer": "2"}, ":line 4: field 'question' is int (7), expected str"),
        ({"question": "q", "answer": True}, ":line 4: field 'answer' is bool (true), expected str or int or float"),
        ({"question": "q", "answer": "#### "}, ":line 4: empty final answer"),  # the task's own make_example
        ("[1, 2]", ":line 4: expected a JSON object, got list"),
    ],
)
def test_the_first_bad_row_is_named_by_file_line_and_field(tmp_path, bad, expected):
    path = jsonl(tmp_path / "data.jsonl", [GOOD, {"question": "q", "answer": 3}, "", bad, GOOD])  # line 3 is blank
    with pytest.raises(ValueError) as err:
        check(path)
    assert str(err.value).startswith(f"{path}{expected}"), err.value


def test_parquet_rows_and_mapped_columns_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"q": ["a?", None, "c?"], "a": ["1", "2", "3"]}), path)
    with pytest.raises(ValueError, match=r"data.parquet:row 2: missing field 'question' \(mapped from column 'q'\)"):
        check(path, fields={"question": "q", "answer": "a"})
    pq.write_table(pa.table({"q": ["a?", "b?"], "a": ["1", "2"]}), path)
    assert check(path, fields={"question": "q", "answer": "a"}) == (2, "")


def test_the_check_stops_at_its_budget_with_a_note_naming_where(tmp_path):
    path = jsonl(tmp_path / "big.jsonl", [GOOD] * 600)
    task = make_task(DatasetConfig(path=str(path)))
    rows, note = check_task_data(task, ["train"], time.monotonic())  # the deadline has passed: stop at once
    assert rows == 256 and note.startswith(f"the data check stopped at {path}:line 256 after its "), note
    assert check_task_data(task, ["train"], time.monotonic() + 60) == (600, "")


def test_up_and_dry_run_refuse_a_bad_file_before_anything_starts(tmp_path, capsys):
    path = jsonl(tmp_path / "data.jsonl", [GOOD, {"question": "q", "answer": "2"}, {"q": "3+3?", "answer": "6"}])
    for dry in (["--dry-run"], []):
        args = ["up", *dry, f"run_dir={tmp_path / 'run'}", "task.name=gsm8k", f"task.dataset.path={path}"]
        assert busctl.main(args) == 2
        err = capsys.readouterr().err
        assert f"task 'gsm8k' data: {path}:line 3: missing field 'question'; present: 'q', 'answer'" in err, err
    assert not (tmp_path / "run").exists()
