"""The live display and ``busctl status`` formatting, rendered to text from snapshots shaped as
``status.json`` is (fields: :mod:`busctl.run_status`); the step clock behind the ETA."""

from __future__ import annotations

import re

import pytest

from busctl.live import format_busy, format_duration, format_rate, header_text, progress_line, render_text
from busctl.run_status import EventLog, StepClock, eta_s

METRICS = {
    "reward_mean": 0.5123,
    "loss": 0.0123,
    "kl": 0.00123,
    "entropy": 1.8765,
    "tokens_per_s": 1234.4,
    "policy_lag_mean": 0.5,
    "policy_lag_max": 1.0,
    "step_time_s": 2.312,
}


def snapshot() -> dict:
    """Step 12 of 60 at 0.4 steps/s; a producer, two reward workers (one restarting), the hub."""
    empty = {
        "throughput": {"samples_per_s": None, "tokens_per_s": None},
        "busy": None,
        "queue_depth": None,
        "queues": {},
    }
    return {
        "name": "reverse_text",
        "state": "running",
        "step": 12,
        "max_steps": 60,
        "trainer_metrics": METRICS,
        "steps_per_s": 0.4,
        "eta_s": 120.0,
        "events": [[1_700_000_000.0 + k, f"event {k}"] for k in range(8)],
        "components": [
            {"name": "hub", "state": "running", "restarts": 0, **empty},
            {
                "name": "producer-0",
                "state": "running",
                "restarts": 0,
                "throughput": {"samples_per_s": 41.6, "tokens_per_s": 1234.4},
                "busy": 0.913,
                "queue_depth": 9.0,
                "queues": {"rollouts/outbox_unfinished": 8.0, "prompts/inbox": 1.0},
            },
            {
                "name": "rewards-0",
                "state": "running",
                "restarts": 0,
                "throughput": {"samples_per_s": 41.0, "tokens_per_s": 0.5},
                "busy": 0.02,
                "queue_depth": 0.0,
                "queues": {"rollouts/inbox": 0.0},
            },
            {"name": "rewards-1", "state": "restarting", "restarts": 2, **empty},
        ],
    }


def rows(text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells
        for line in text.splitlines()
        if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == 7
    }


def test_header_holds_step_learning_values_lag_and_eta():
    assert header_text(snapshot()) == (
        "reverse_text running | step 12/60 | reward 0.512 | KL 0.0012 | entropy 1.877"
        " | lag 0.50/1 | 2.31 s/step | ETA 2m00s"
    )
    before = {**snapshot(), "step": None, "trainer_metrics": {}, "eta_s": None}
    assert header_text(before) == "reverse_text running | step -/60"


def test_render_shows_every_component_and_the_last_events():
    text = render_text(snapshot(), width=100)
    table = rows(text)
    assert table["component"] == ["component", "state", "samples/s", "tokens/s", "busy", "queue", "restarts"]
    assert table["producer-0"] == ["producer-0", "running", "41.6", "1,234", "91%", "9", "0"]
    assert table["rewards-0"] == ["rewards-0", "running", "41.0", "0.50", "2%", "0", "0"]
    assert table["rewards-1"] == ["rewards-1", "restarting", "-", "-", "-", "-", "2"]
    assert [e for e in ("event 2", "event 3", "event 7") if e in text] == ["event 3", "event 7"]  # the last 5 only
    assert text.splitlines()[0].startswith("reverse_text running | step 12/60")


def test_progress_line_keeps_its_format():
    assert progress_line(12, 60, METRICS) == (
        "step   12/60 | reward 0.512 | loss +0.0123 | kl 0.0012 | 1,234 all tok/s | lag 0.50/1 | 2.31 s"
    )


def test_formats():
    assert [format_duration(s) for s in (None, 0, 59.4, 61, 3599, 3725)] == [
        "-",
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "1h02m",
    ]
    assert [format_rate(v) for v in (None, 0.0, 0.25, 12.5, 1234.4)] == ["-", "0.00", "0.25", "12.5", "1,234"]
    assert [format_busy(v) for v in (None, 0.0, 0.913, 1.0)] == ["-", "0%", "91%", "100%"]


def test_eta_from_the_recent_step_rate():
    assert eta_s([], 10) == (None, None) and eta_s([(5.0, 1)], 10) == (None, None)
    assert eta_s([(0.0, 1), (0.0, 2)], 10) == (None, None)  # no time between them
    rate, eta = eta_s([(100.0, 2), (104.0, 3), (110.0, 5)], 20)
    assert rate == pytest.approx(0.3) and eta == pytest.approx(15 / 0.3)
    clock = StepClock()
    for k in range(1, 25):  # only the last STEP_WINDOW steps count: a slow start does not skew the ETA
        clock.step(k, now=1000.0 * k if k < 10 else 1000.0 * 9 + 2.0 * (k - 9))
    rate, eta = clock.rate_and_eta(30)
    assert rate == pytest.approx(0.5) and eta == pytest.approx(12.0)


def test_event_log_keeps_plain_text_of_the_last_events():
    log = EventLog()
    for k in range(25):
        log.add(f"  [green]ready[/green] rewards-{k} (pid {k})", now=float(k))
    events = log.recent()
    assert (
        len(events) == 20
        and events[0] == [5.0, "ready rewards-5 (pid 5)"]
        and events[-1][1] == "ready rewards-24 (pid 24)"
    )
