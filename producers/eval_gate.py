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
