"""One checkpoint save at a time on a background thread, off the trainer's hot path: the trainer
snapshots the state (:func:`trainer.state.checkpoint.snapshot_state`), :meth:`BackgroundSave.start`
writes it while the next step trains, and each save comes back once on the caller's thread, its
exception re-raised there (a step is released only once its save came back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path


class BackgroundSave:
    """Runs at most one save (a callable returning the checkpoint path) on a background thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save not yet handed back (running or done), or None."""
        return self._step

    def start(self, step: int, save: Callable[[], Path]) -> None:
        """Run ``save`` on a new thread for checkpoint ``step``; ValueError while one is in flight."""
        if self._step is not None:
            raise ValueError(
                f"the checkpoint of step {self._step} is still in flight; wait() for it before saving step {step}"
            )

        def run() -> None:
            try:
                self._result = save()
            except BaseException as exc:
                self._error = exc

        self._step, self._result, self._error = step, None, None
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def finished(self) -> tuple[int, Path] | None:
        """``(step, path)`` of the save in flight once it completed (once), else None; never blocks.
        Re-raises the save's exception."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self._hand_back()

    def wait(self) -> tuple[int, Path] | None:
        """Block until the save in flight completes: ``(step, path)`` (once), or None if none was in
        flight. Re-raises the save's exception."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._hand_back()

    def _hand_back(self) -> tuple[int, Path]:
        step, result, error = self._step, self._result, self._error
        self._thread, self._step, self._result, self._error = None, None, None, None
        if error is not None:
            raise error
        assert step is not None and result is not None
        return step, result
