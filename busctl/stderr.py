"""Where ``busctl``'s error and warning messages go: standard error, so that what a command prints
on standard output stays clean (``busctl up --dry-run > cfg.yaml`` holds YAML or nothing).

Messages are plain text: a config value such as ``[1`` is never read as rich markup. Red (errors)
and yellow (warnings) only where standard error is a terminal.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def _console() -> Console:
    # made per call: it writes to the sys.stderr of that moment (pytest's capture, a redirection)
    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    """Print ``message`` (plain text, any length and lines) on standard error, red on a terminal."""
    _console().print(Text(message, style="red"))


def print_warning(message: str) -> None:
    """Print ``warning: message`` on standard error, yellow on a terminal."""
    _console().print(Text(f"warning: {message}", style="yellow"))
