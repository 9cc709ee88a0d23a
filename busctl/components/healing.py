"""The supervisor's healing policy, as a pure function: component facts and a clock in, decisions out.

:func:`decide` judges every component at ``now`` (``time.monotonic()`` seconds) from :class:`ComponentFacts` and
:class:`HealingRules` (from the run config) and returns a :class:`RestartNow` (backoff ran out), a
:class:`ScheduleRestart` (just crashed: exited, not ready within ``bus.ready_timeout_s`` or silent for
``bus.dead_after_s``) or a :class:`FailRun` (at start-up, ``supervisor.restart`` off, or the restart budget
spent) per component that needs one. Nothing here reads the clock or touches a process, socket or file: the
supervisor gathers the facts and carries the decisions out in order. Components being scaled away
(``stopping``) are :mod:`busctl.scaling`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from busctl.components.table import LIVE_STATES, RESTARTABLE_ROLES, ComponentState, describe_exit
from configs.schema import RunConfig, SupervisorConfig


def backoff_s(consecutive_crashes: int, sup: SupervisorConfig) -> float:
    """Delay before restarting after the ``consecutive_crashes``-th crash in a row, seconds:
    ``min(backoff_max_s, backoff_initial_s * 2**(consecutive_crashes - 1))``; the count restarts from 1 once the
    component stayed up ``backoff_reset_s``.

    Raises:
        ValueError: ``consecutive_crashes < 1``.
    """
    if consecutive_crashes < 1:
        raise ValueError(f"consecutive_crashes must be >= 1, got {consecutive_crashes}")
    return min(sup.backoff_max_s, sup.backoff_initial_s * 2.0 ** min(consecutive_crashes - 1, 60))


@dataclass(frozen=True)
class HealingRules:
    """The rules :func:`decide` applies (from the run config); ``healing`` False at start-up, where any crash fails
    the run; ``ready_timeout_s`` / ``dead_after_s``: seconds to the ready handshake, and of silence after it."""

    healing: bool
    supervisor: SupervisorConfig
    ready_timeout_s: float
    dead_after_s: float
    run_dir: str = ""

    @classmethod
    def from_config(cls, cfg: RunConfig, *, healing: bool, run_dir: str) -> "HealingRules":
        """The rules of a run."""
        return cls(
            healing=healing,
            supervisor=cfg.supervisor,
            ready_timeout_s=cfg.bus.ready_timeout_s,
            dead_after_s=cfg.bus.dead_after_s,
            run_dir=run_dir,
        )


@dataclass(frozen=True)
class ComponentFacts:
    """What the policy knows of one component (times are ``time.monotonic()`` seconds).

    Attributes:
        exit_code: of its process if that has exited (negative: killed by a signal), else None.
        consecutive_crashes: crashes in a row before this one.
        ready_at, last_beat: last ready handshake and heartbeat (None: not yet).
        due: ``starting``: ready deadline; ``restarting``: when to spawn it again.
    """

    name: str
    role: str
    state: ComponentState
    pid: int = 0
    exit_code: int | None = None
    restarts: int = 0
    consecutive_crashes: int = 0
    ready_at: float | None = None
    last_beat: float | None = None
    due: float = 0.0


@dataclass(frozen=True)
class RestartNow:
    """Spawn ``name`` again now (its backoff ran out)."""

    name: str


@dataclass(frozen=True)
class ScheduleRestart:
    """``name`` crashed (``reason``): kill what is left of it and spawn it again at ``at`` (``now + delay_s``)."""

    name: str
    reason: str
    at: float
    delay_s: float
    consecutive_crashes: int


@dataclass(frozen=True)
class FailRun:
    """``name`` crashed (``reason``) and is not restarted: kill what is left, end the run with ``message`` (the
    supervisor adds its log's path)."""

    name: str
    reason: str
    message: str


Decision = Union[RestartNow, ScheduleRestart, FailRun]


def crash_reason(facts: ComponentFacts, now: float, rules: HealingRules) -> str | None:
    """Why the component has crashed at ``now``, or None (also when it is not watched: restarting, stopping)."""
    if facts.state != ComponentState.STARTING and facts.state not in LIVE_STATES:
        return None
    if facts.exit_code is not None:
        return describe_exit(facts.exit_code)
    if facts.state == ComponentState.STARTING:
        return f"was not ready within {rules.ready_timeout_s:g} s" if now > facts.due else None
    silent = now - max(facts.ready_at or 0.0, facts.last_beat or 0.0)
    if silent > rules.dead_after_s:
        return f"was silent for {silent:.1f} s (no heartbeat; bus.dead_after_s={rules.dead_after_s:g})"
    return None


def on_crash(facts: ComponentFacts, reason: str, now: float, rules: HealingRules) -> ScheduleRestart | FailRun:
    """What to do about a component that crashed at ``now`` for ``reason``."""
    sup = rules.supervisor
    if not rules.healing or not sup.restart:
        return FailRun(facts.name, reason, f"{facts.name} {reason}")
    if facts.role not in RESTARTABLE_ROLES:
        return FailRun(facts.name, reason, f"{facts.name} {reason} and cannot be restarted")
    if facts.restarts >= sup.max_restarts:
        return FailRun(
            facts.name,
            reason,
            f"{facts.name} {reason} after {facts.restarts} restarts: its restart budget "
            f"(supervisor.max_restarts={sup.max_restarts}) is spent",
        )
    crashes = facts.consecutive_crashes
    if facts.ready_at is not None and now - facts.ready_at >= sup.backoff_reset_s:
        crashes = 0
    crashes += 1
    delay = backoff_s(crashes, sup)
    return ScheduleRestart(facts.name, reason, at=now + delay, delay_s=delay, consecutive_crashes=crashes)


def decide(components: Sequence[ComponentFacts], now: float, rules: HealingRules) -> list[Decision]:
    """The healing decisions for ``components`` (in table order) at ``now``; a :class:`FailRun` ends the run,
    no decision after it is carried out."""
    decisions: list[Decision] = []
    for facts in components:
        if facts.state == ComponentState.RESTARTING:
            if now >= facts.due:
                decisions.append(RestartNow(facts.name))
            continue
        reason = crash_reason(facts, now, rules)
        if reason is not None:
            decisions.append(on_crash(facts, reason, now, rules))
    return decisions
