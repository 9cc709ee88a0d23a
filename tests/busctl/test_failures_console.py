"""What ``busctl up`` prints when user code fails: a real :class:`busctl.supervisor.Supervisor` (through
:func:`busctl.cli.supervise`, as ``busctl up`` runs it) over a real component
(``tests/busctl/failing_work.py``) that scores groups with a real reward worker whose functions fail and reports
their shares in its heartbeats over ZeroMQ; and a component that raises while starting."""

from __future__ import annotations

import json
import re

from busctl import cli as busctl
from busctl.components.table import ComponentSpec
from tests.busctl.test_supervisor import make_cfg, supervisors  # noqa: F401 (a fixture)

FAILING = "tests.busctl.failing_work"


def specs() -> list[ComponentSpec]:
    return [ComponentSpec("rewards-0", FAILING, 0)]  # heartbeats go straight to busctl: no hub needed


def test_a_failing_reward_function_warns_then_stops_the_run_with_exit_1(tmp_path, supervisors, capsys):
    cfg = make_cfg(
        tmp_path / "run",
        "rewards.error_window=8",
        "rewards.warn_error_fraction=0.1",
        "rewards.max_error_fraction=0.5",
    )
    run = supervisors(cfg, specs())
    assert run.join() == 1
    out = run.out.getvalue()
    # by_text fails on 1 call in 4 (ValueError): a warning naming it, its error, first message and share
    assert re.search(
        r"warning reward function 'by_text' fails on 25% of its last [48] calls in rewards-0 \(\d+ of \d+ failed so "
        r"far\): ValueError: cannot score 'raise' \(the run stops past rewards.max_error_fraction=0.5\)",
        out,
    ), out
    # raises fails on every call: a warning, then past rewards.max_error_fraction the run stops, naming it
    warned = out.index("warning reward function 'raises' fails on 100% of its last ")
    assert warned < out.index("run failed: ")
    assert re.search(
        r"run failed: reward function 'raises' fails on 100% of its last 8 calls in rewards-0 \((\d+) of \1 failed "
        r"so far\), above rewards.max_error_fraction=0.5; first error: ValueError: cannot score 'raise'; see ",
        out,
    ), out
    status = run.status()
    assert status["outcome"] == "failed" and "'raises' fails on 100%" in status["error"]
    failures = status["failures"]
    assert failures["raises"]["level"] == "stop" and failures["raises"]["errors"] == failures["raises"]["calls"]
    assert failures["by_text"]["level"] == "warn" and failures["by_text"]["message"] == "cannot score 'raise'"
    capsys.readouterr()
    assert busctl.main(["status", str(run.run_dir)]) == 0
    shown = capsys.readouterr().out
    assert re.search(
        r"failures: reward function raises: (\d+) of \1 calls failed \(100% of recent calls\); first: ", shown
    )


def test_a_component_that_fails_while_starting_puts_its_exception_on_the_console(tmp_path, supervisors):
    cfg = make_cfg(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "fail-setup-rewards-0").write_text("data.jsonl:line 3: missing field 'question'\nsecond")
    run = supervisors(cfg, specs())
    assert run.join() == 1
    out = run.out.getvalue()
    assert "run failed: rewards-0 " in out and (
        "ValueError: data.jsonl:line 3: missing field 'question' second; see " in out
    ), out


def test_failures_merge_over_processes_and_reach_the_report_summary(tmp_path):
    from busctl.failures import FailureBoard, failure_lines
    from busctl.report import format_summary, summarize
    from busctl.run_data import load_run

    rec = {"kind": "reward", "calls": 64, "errors": 16, "share": 0.25, "window": 64, "level": "warn", "error": ""}
    board = FailureBoard(max_fraction=0.5)
    lines, stop = board.update("rewards-0", 11, {"judge": {**rec, "error": "KeyError", "message": "'answer'"}})
    assert stop is None and len(lines) == 1 and "reward function 'judge' fails on 25% " in lines[0]
    assert (
        board.update("rewards-1", 12, {"judge": {**rec, "share": 0.5, "error": "TimeoutError", "message": "x"}})[0]
        == []
    )
    assert (
        board.update("rewards-0", 13, {"judge": {**rec, "calls": 8, "errors": 8, "share": 1.0, "message": "y"}})[1]
        is None
    )
    merged = board.summary()["judge"]  # a restarted process (pid 13) adds to its predecessor's counts
    assert (merged["calls"], merged["errors"], merged["share"], merged["error"]) == (136, 40, 1.0, "KeyError")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5, "reward_mean": 0.25}) + "\n")
    (run / "status.json").write_text(json.dumps({"failures": board.summary()}))
    text = format_summary(load_run(run), summarize(load_run(run)), [])
    assert f"failures: {failure_lines(board.summary())[0]}" in text
    assert (
        "failures: reward function judge: 40 of 136 calls failed (100% of recent calls); first: KeyError: 'answer'"
        in text
    )
