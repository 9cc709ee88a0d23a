"""What ``busctl up`` shows on a terminal, and the formatting ``busctl status`` shares with it.

The live display (a header with the trainer's values, ETA and phase shares; a row per component; the recent
events) is rendered from a ``status.json`` snapshot, never from the supervisor's live objects, so rich's refresh
thread cannot race the watch loop and :func:`render_text` shows exactly what a snapshot looks like. Progress and
event lines print above it; without a terminal ``busctl up`` prints only those lines.
"""

from __future__ import annotations

import io
import time
from typing import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from busctl.run_data import PHASE_LABELS

EVENTS_SHOWN = 5
"""Recent events under the table."""

REFRESH_PER_S = 2.0
"""Display refreshes per second."""


def progress_line(step: int, max_steps: int, m: dict) -> str:
    """``step   12/60 | reward 0.512 | loss +0.0123 | kl 0.0010 | 1,234 all tok/s | lag 0.50/1 | 2.31 s``
    from a ``trainer.step`` message's metrics ``m`` (a missing key shows as 0)."""
    return (
        f"step {step:>4}/{max_steps} | reward {m.get('reward_mean', 0):.3f}"
        f" | loss {m.get('loss', 0):+.4f} | kl {m.get('kl', 0):.4f} | {m.get('tokens_per_s', 0):,.0f} all tok/s"
        f" | lag {m.get('policy_lag_mean', 0):.2f}/{m.get('policy_lag_max', 0):.0f} | {m.get('step_time_s', 0):.2f} s"
    )


def format_duration(seconds: float | None) -> str:
    """``"1h02m"``, ``"3m05s"``, ``"12s"``; ``"-"`` for None."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_rate(value: float | None) -> str:
    """A per-second rate: ``"1,234"``, ``"12.5"``, ``"0.25"``; ``"-"`` when unknown."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def format_busy(value: float | None) -> str:
    """A busy fraction as a percentage (``"73%"``); ``"-"`` when unknown."""
    return "-" if value is None else f"{100 * value:.0f}%"


def format_queue(row: dict) -> str:
    """A component's queue depth (messages, all topics and queues); ``"-"`` when unknown."""
    depth = row.get("queue_depth")
    return "-" if depth is None else f"{depth:.0f}"


def phase_shares(m: dict) -> dict[str, float]:
    """The trainer's share of wall time per phase from a ``trainer.step``'s metrics ``m``: the recent window's
    ``time_share/<phase>``, else the step's ``time/<phase>_s`` over their sum; in :data:`PHASE_LABELS` order, empty
    without either."""
    shares = {k[len("time_share/") :]: float(v) for k, v in m.items() if k.startswith("time_share/")}
    if not shares:
        times = {
            k[len("time/") : -len("_s")]: float(v)
            for k, v in m.items()
            if k.startswith("time/") and k.endswith("_s") and isinstance(v, (int, float)) and v >= 0
        }
        total = sum(times.values())
        shares = {p: t / total for p, t in times.items()} if total > 0 else {}
    order = [p for p in PHASE_LABELS if p in shares] + sorted(p for p in shares if p not in PHASE_LABELS)
    return {p: shares[p] for p in order}


def phase_text(m: dict) -> str:
    """``wait 3% fwd 31% bwd 52% opt 2% send 4% other 8%`` (:func:`phase_shares`); ``""`` without them."""
    return " ".join(f"{PHASE_LABELS.get(p, p)} {100 * v:.0f}%" for p, v in phase_shares(m).items())


def trainer_text(snap: dict, eta: bool = True) -> str:
    """``step 12/60 | reward .. | KL .. | entropy .. | lag m/M | 2.31 s/step | ETA .. | wait 3% fwd ..``
    (``step -/60`` before the first step; no ETA with ``eta=False``: a run that has stopped)."""
    step, max_steps = snap.get("step"), snap.get("max_steps")
    parts = [f"step {'-' if step is None else step}/{max_steps if max_steps is not None else '?'}"]
    m = snap.get("trainer_metrics") or {}
    for label, key, fmt in (("reward", "reward_mean", ".3f"), ("KL", "kl", ".4f"), ("entropy", "entropy", ".3f")):
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}")
    if "policy_lag_mean" in m:
        parts.append(f"lag {m['policy_lag_mean']:.2f}/{m.get('policy_lag_max', 0):.0f}")
    if "step_time_s" in m:
        parts.append(f"{m['step_time_s']:.2f} s/step")
    if step is not None and eta:
        parts.append(f"ETA {format_duration(snap.get('eta_s'))}")
    if phases := phase_text(m):
        parts.append(phases)
    return " | ".join(parts)


def header_text(snap: dict) -> str:
    """One line: ``NAME STATE | `` and :func:`trainer_text`."""
    return f"{snap.get('name', '')} {snap.get('state', '?')}".strip() + " | " + trainer_text(snap)


def components_view(snap: dict) -> Table:
    """The per-component table of a snapshot."""
    table = Table()
    for col, justify in (
        ("component", "left"),
        ("state", "left"),
        ("samples/s", "right"),
        ("tokens/s", "right"),
        ("busy", "right"),
        ("queue", "right"),
        ("restarts", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)
    for row in snap.get("components", []):
        tp = row.get("throughput") or {}
        table.add_row(
            row["name"],
            row.get("state", "?"),
            format_rate(tp.get("samples_per_s")),
            format_rate(tp.get("tokens_per_s")),
            format_busy(row.get("busy")),
            format_queue(row),
            str(row.get("restarts", 0)),
        )
    return table


def render(snap: dict) -> RenderableType:
    """The whole display of one snapshot: header, component table, recent events."""
    parts: list[RenderableType] = [Text(header_text(snap), style="bold"), components_view(snap)]
    for at, text in (snap.get("events") or [])[-EVENTS_SHOWN:]:
        parts.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(at))} {text}", style="dim"))
    return Group(*parts)


def render_text(snap: dict, width: int = 120) -> str:
    """:func:`render` as plain text ``width`` columns wide (what a terminal shows, without colour)."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False).print(render(snap))
    return out.getvalue()


class LiveDisplay:
    """A rich ``Live`` region at the bottom of ``console`` showing ``snapshot()``; a context manager. Lines printed
    meanwhile appear above it; the last state stays on screen after exit. ``snapshot`` is called on rich's refresh
    thread: it must only read."""

    def __init__(self, console: Console, snapshot: Callable[[], dict]) -> None:
        self.live = Live(
            console=console,
            get_renderable=lambda: render(snapshot()),
            refresh_per_second=REFRESH_PER_S,
            transient=False,
            redirect_stdout=True,
            redirect_stderr=True,
        )

    def __enter__(self) -> "LiveDisplay":
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()
