"""TensorBoard: event files under ``RUN_DIR/tensorboard/``, through PyTorch's ``SummaryWriter``.

Scalars under their record's names (eval as ``eval/<task>/<metric>`` at the round), the config in the HPARAMS
tab and as YAML text, samples as Markdown tables in the TEXT tab. A resume appends a new event file to the same
directory; TensorBoard merges them.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from trackers.base import Tracker

__all__ = ["TensorBoardTracker", "markdown_table"]

TEXT_CELL_CHARS = 2000
"""A table cell longer than this many characters is cut (TensorBoard's text view shows all of it, slowly)."""

LINE_BREAKS = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
"""Every line boundary of :meth:`str.splitlines`."""


def markdown_table(columns: tuple[str, ...], rows: list[list]) -> str:
    """A Markdown table (TensorBoard renders text summaries as Markdown), one row per line: ``|`` escaped, every
    line break :meth:`str.splitlines` knows made ``<br>``, cells cut at :data:`TEXT_CELL_CHARS`."""

    def cell(value: object) -> str:
        text = "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        return LINE_BREAKS.sub("<br>", text[:TEXT_CELL_CHARS].replace("|", "\\|"))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardTracker(Tracker):
    """Writes the run's records as TensorBoard events under ``RUN_DIR/tensorboard/``; ImportError without it."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict, state: dict) -> None:
        super().__init__(run_dir, config, state)
        from torch.utils.tensorboard import SummaryWriter  # torch is heavy: only in the tracker process

        self.logdir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=30)

    def log_config(self, hparams: dict[str, str | int | float | bool]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        for summary in hparams_summaries(hparams, {}):  # experiment, session start, session end
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(self.config, sort_keys=False) + "```", 0)

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, columns: tuple[str, ...], rows: list[list]) -> None:
        self.writer.add_text("samples", markdown_table(columns, rows), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
