"""The producers' eval gate: every eval group is sampled under one policy version (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class EvalUpdateGate:
    """An update waits for the eval requests in flight; no eval request starts while one is pending.

    No deadlock: an eval request in flight never waits for an update. Training requests bypass it. One event loop.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.evals_in_flight = 0
        self.updates_pending = 0

    @contextlib.asynccontextmanager
    async def eval_request(self) -> AsyncIterator[None]:
        """Hold for the duration of one eval group's generation."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.updates_pending == 0)
            self.evals_in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self.evals_in_flight -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        """Hold for the duration of one weight update (pause, load, resume)."""
        async with self._cond:
            self.updates_pending += 1
            try:
                await self._cond.wait_for(lambda: self.evals_in_flight == 0)
            except BaseException:
                self.updates_pending -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self.updates_pending -= 1
                self._cond.notify_all()


class EvalRoundHold:
    """Weight updates past an eval round's version wait for that round's results, so every sample of round ``r``
    is sampled under version ``r`` (a round's prompts reach a producer a credit window at a time, so the update
    gate above alone let a round span two versions).

    ``rounds``: the versions evaluated (:meth:`configs.rollout.EvalConfig.round_versions`); ``tasks``: the eval
    tasks whose ``eval.result`` closes a round; ``timeout_s``: the longest hold, after which the update goes ahead
    and the round's records show the versions it spans.
    """

    def __init__(self, rounds: list[int], tasks: set[str], timeout_s: float) -> None:
        self.open = set(rounds)
        self.tasks = set(tasks)
        self.timeout_s = float(timeout_s)
        self._seen: dict[int, set[str]] = {}

    def on_result(self, round_: int, task: str) -> None:
        """Note one task's ``eval.result`` of ``round_``; the round closes once every task's is seen."""
        seen = self._seen.setdefault(round_, set())
        seen.add(task)
        if self.tasks <= seen:
            self.open.discard(round_)
            self._seen.pop(round_, None)

    def holds(self, version: int, new_version: int) -> bool:
        """Must the update from ``version`` to ``new_version`` wait (round ``version`` still open)?"""
        return new_version > version and version in self.open

    def forget_through(self, version: int) -> None:
        """Hold for no round <= ``version`` (a restarted or resumed producer: those rounds may be re-runs)."""
        self.open = {r for r in self.open if r > version}
