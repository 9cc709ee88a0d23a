"""``packer.sample_log.SamplesLog``: which steps are sampled, what a line holds, and that an I/O
error is counted instead of raised (the packer must keep training). Also the ``report`` config
section's bounds."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from configs.schema import ConfigError, load_config
from packer.sample_log import SamplesLog, sample_records
from tests.packer.test_packer_proc import group


def groups():
    a = dataclasses.replace(
        group("a", [1.0, 0.0], version=3),
        prompt_text="reverse: abc",
        completion_texts=["cba", "ab"],
        finish_reasons=["stop", "length"],
        masked=np.array([False, True]),
    )
    return [a, group("b", [0.5, 0.25], version=4)]


def test_due_steps_start_at_zero_and_zero_interval_is_off(tmp_path):
    log = SamplesLog(tmp_path / "samples.jsonl", interval=3, per_step=2)
    assert [s for s in range(10) if log.due(s)] == [0, 3, 6, 9]
    off = SamplesLog(tmp_path / "off.jsonl", interval=0, per_step=2)
    assert not any(off.due(s) for s in range(10))
    assert off.write(0, groups()) == 0 and not off.path.exists()
    with pytest.raises(ValueError, match="per_step"):
        SamplesLog(tmp_path / "x", interval=-1, per_step=1)
    with pytest.raises(ValueError, match="per_step"):
        SamplesLog(tmp_path / "x", interval=1, per_step=0)


def test_lines_are_the_first_samples_in_group_order(tmp_path):
    log = SamplesLog(tmp_path / "samples.jsonl", interval=2, per_step=3)
    assert log.write(4, groups()) == 3
    assert log.write(5, groups()) == 0  # not due
    assert log.write(6, groups()[:1]) == 2  # fewer samples than per_step
    lines = log.path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["group_id"], r["sample"]) for r in records] == [
        (4, "a", 0),
        (4, "a", 1),
        (4, "b", 0),
        (6, "a", 0),
        (6, "a", 1),
    ]
    first, second, third = records[:3]
    assert (first["prompt"], first["completion"], first["finish_reason"]) == ("reverse: abc", "cba", "stop")
    assert (second["completion"], second["finish_reason"], second["masked"]) == ("ab", "length", True)
    assert (first["reward"], first["advantage"], second["advantage"]) == (1.0, 0.5, -0.5)
    assert (first["policy_version"], first["lag"], third["policy_version"], third["lag"]) == (3, 1, 4, 0)
    assert third["prompt"] == "" and third["masked"] is False
    expected = {
        "step",
        "time",
        "group_id",
        "task",
        "sample",
        "group_size",
        "prompt",
        "completion",
        "reward",
        "advantage",
        "reward_terms",
        "policy_version",
        "lag",
        "version_spans",
        "finish_reason",
        "completion_tokens",
        "masked",
        "producer",
    }
    assert all(set(r) == expected for r in records)


def test_limit_zero_and_unicode_round_trip():
    g = dataclasses.replace(group("u", [1.0, 1.0]), completion_texts=['é\n"x"', "日本"])
    assert sample_records(0, [g], 0) == []
    recs = sample_records(0, [g], 5, now=12.5)
    assert [r["completion"] for r in recs] == ['é\n"x"', "日本"] and recs[0]["time"] == 12.5


def test_an_io_error_is_counted_not_raised(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the run directory should be")
    log = SamplesLog(blocker / "samples.jsonl", interval=1, per_step=2)
    assert log.write(0, groups()) == 0
    assert log.write(1, groups()) == 0
    assert log.errors == 2


@pytest.mark.parametrize(
    "override", ["report.samples_interval=-1", "report.samples_per_step=0", "report.samples_per_step=65"]
)
def test_report_config_bounds(override):
    with pytest.raises(ConfigError):
        load_config(None, [override])


def test_report_config_defaults():
    cfg = load_config(None, [])
    assert (cfg.report.samples_interval, cfg.report.samples_per_step) == (10, 4)
