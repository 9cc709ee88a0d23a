"""What ``busctl up`` says about failures: the exception at the end of a component's log (a component that fails
names its cause on the console, not only its log), and the failure shares of user functions that reward workers
and producers report in their heartbeats (:mod:`telemetry.failure_window`): a warning when a function crosses
``rewards.warn_error_fraction``, the stop past ``rewards.max_error_fraction``, and the totals kept for
``status.json``, ``busctl status`` and ``busctl report``.
"""

from __future__ import annotations

import re
from pathlib import Path

from rich.markup import escape

KIND_NAMES = {"reward": "reward function", "env": "environment", "agent": "agent"}
LEVEL_RANK = {"ok": 0, "warn": 1, "stop": 2}
TAIL_BYTES = 64 * 1024  # of a log, read for its last exception
MAX_EXCEPTION_CHARS = 400

_EXCEPTION_LINE = re.compile(
    r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed|Warning)\b.*|^[A-Za-z_][\w.]*: .+"
)


def last_exception(log_path: Path) -> str:
    """The last traceback's exception line(s) in the latest start of ``log_path`` (``"ValueError: ..."``, at most
    :data:`MAX_EXCEPTION_CHARS`), or ``""`` when there is none or the file cannot be read."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("===== rlbus ")]
    lines = lines[starts[-1] + 1 :] if starts else lines
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not tracebacks:
        return ""
    out: list[str] = []
    for line in lines[tracebacks[-1] + 1 :]:
        if not out:
            if line.startswith((" ", "\t")) or not _EXCEPTION_LINE.match(line):
                continue  # a frame, its source line, or a caret marker
            out.append(line.strip())
        elif line.strip() and not line.startswith((" ", "\t")) and not _looks_like_log_line(line):
            out.append(line.strip())  # a message over several lines
        else:
            break
    return " ".join(out)[:MAX_EXCEPTION_CHARS]


def _looks_like_log_line(line: str) -> bool:
    return bool(re.match(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d", line))


class FailureBoard:
    """The latest failure report of every component process (by name and pid), merged per function.
    ``max_fraction``: ``rewards.max_error_fraction``, named in the messages."""

    def __init__(self, max_fraction: float) -> None:
        self.max_fraction = max_fraction
        self._reports: dict[tuple[str, int], dict[str, dict]] = {}
        self._warned: set[str] = set()

    def update(self, component: str, pid: int, failures: dict[str, dict]) -> tuple[list[str], str | None]:
        """Take one heartbeat's ``failures``; returns the console lines to print (rich markup) and the stop
        message when a function of it is past ``max_fraction`` (else None)."""
        if not failures and (component, pid) not in self._reports:
            return [], None
        self._reports[(component, pid)] = failures
        lines = []
        stop = None
        for name, rec in failures.items():
            what = f"{KIND_NAMES.get(rec['kind'], rec['kind'])} {name!r}"
            share = (
                f"{100 * rec['share']:.0f}% of its last {rec['window']} calls in {component} "
                f"({rec['errors']} of {rec['calls']} failed so far)"
            )
            cause = f"{rec['error']}: {rec['message']}" if rec["message"] != rec["error"] else rec["error"]
            if rec["level"] == "stop" and stop is None:
                stop = (
                    f"{what} fails on {share}, above rewards.max_error_fraction={self.max_fraction:g}; "
                    f"first error: {cause}"
                )
            if rec["level"] in ("warn", "stop") and name not in self._warned:  # a stop is warned of too
                self._warned.add(name)
                then = (
                    f"the run stops past rewards.max_error_fraction={self.max_fraction:g}"
                    if self.max_fraction < 1
                    else "rewards.max_error_fraction=1: the run goes on"
                )
                lines.append(
                    f"  [yellow]warning[/yellow] {escape(what)} fails on {escape(share)}: {escape(cause)} ({then})"
                )
        for name in list(self._warned):
            if all(r.get(name, {}).get("level", "ok") == "ok" for r in self._reports.values()):
                self._warned.discard(name)  # recovered everywhere: a new crossing warns again
        return lines, stop

    def summary(self) -> dict[str, dict]:
        """Per function: ``kind``, ``calls`` and ``errors`` summed over every process so far, the highest recent
        ``share`` and ``level``, and the first reported ``error`` and ``message``."""
        out: dict[str, dict] = {}
        for report in self._reports.values():
            for name, rec in report.items():
                s = out.get(name)
                if s is None:
                    out[name] = {k: rec[k] for k in ("kind", "calls", "errors", "share", "error", "message", "level")}
                    continue
                s["calls"] += rec["calls"]
                s["errors"] += rec["errors"]
                s["share"] = max(s["share"], rec["share"])
                s["level"] = max(s["level"], rec["level"], key=LEVEL_RANK.get)
        return out


def failure_lines(failures: dict[str, dict]) -> list[str]:
    """Plain-text lines of a :meth:`FailureBoard.summary` (``busctl status``, ``busctl report``): function, failed
    calls of all calls, the recent share and the first error, worst first."""
    lines = []
    for name, s in sorted(failures.items(), key=lambda kv: (-kv[1]["errors"], kv[0])):
        cause = f"{s['error']}: {s['message']}" if s["message"] != s["error"] else s["error"]
        lines.append(
            f"{KIND_NAMES.get(s['kind'], s['kind'])} {name}: {s['errors']} of {s['calls']} calls failed "
            f"({100 * s['share']:.0f}% of recent calls); first: {cause}"
        )
    return lines


def read_failures(run_dir: Path) -> dict[str, dict]:
    """The failure summary of a run's ``status.json`` (:meth:`FailureBoard.summary`); ``{}`` when it has none."""
    import json

    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    failures = status.get("failures") if isinstance(status, dict) else None
    return failures if isinstance(failures, dict) else {}
