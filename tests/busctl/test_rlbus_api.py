"""``rlbus.run``'s refusals, before anything starts: the config's own error, and busctl up's message as a
:class:`rlbus.RunError` (the signal handlers it installs are put back)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import rlbus
from configs.schema import ConfigError


def test_refusals_raise_with_busctl_ups_message(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(ConfigError, match="did you mean trainer.max_steps"):
        rlbus.run(None, [f"run_dir={tmp_path / 'run'}", "trainer.max_step=3"])
    with pytest.raises(rlbus.RunError, match="did you mean 'gsm8k'") as err:
        rlbus.run(None, [f"run_dir={tmp_path / 'run'}", "task.name=gsm9k"])
    assert err.value.exit_code == 2 and not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGINT) is before
