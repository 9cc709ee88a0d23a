"""One checkpoint save at a time on a background thread, so file writes and fsyncs leave the
trainer's hot path: the trainer snapshots the state on its own thread
(:func:`trainer.state.checkpoint.snapshot_state`), then :meth:`BackgroundSave.start` writes it while
the next step trains. Each completed save is handed back once, on the caller's thread, with its
exception re-raised there; the caller releases a step only once its save came back.
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
        """Run ``save`` on a new thread for checkpoint ``step``.

        Raises:
            ValueError: a save is still in flight (call :meth:`wait` first).
        """
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
        """``(step, path)`` of the save in flight if it has completed (once), else None; never blocks.

        Raises:
            Exception: the save's own exception, if it failed.
        """
        if self._thread is None or self._thread.is_alive():
            return None
        return self._hand_back()

    def wait(self) -> tuple[int, Path] | None:
        """Block until the save in flight completes; ``(step, path)`` (once), or None if none was in flight.

        Raises:
            Exception: the save's own exception, if it failed.
        """
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
