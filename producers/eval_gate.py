"""The producers' eval gate: every eval group is sampled under one policy version.

The prompt source issues eval round ``r`` once every producer runs version ``>= r``
(:mod:`prompts.eval_rounds`); that the round is then sampled under exactly one version is the
producers' side, this gate: a weight update waits for the in-flight eval requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class EvalUpdateGate:
    """Producer side: every eval group is sampled under one policy version.

    A weight update (:meth:`update`) waits until the in-flight eval requests (:meth:`eval_request`)
    are finished, and no eval request starts while an update is pending or running; training
    requests do not go through the gate (they keep running across an update, as partial
    rollouts). No deadlock: an eval request in flight never waits for an update, and an update
    waits only for eval requests already in flight. Use from one event loop.
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
