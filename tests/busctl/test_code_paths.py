"""``task.code_paths`` reach every component: the supervisor puts them on the ``PYTHONPATH`` it hands the launcher,
so a module in the user's folder imports in a process started exactly as components are."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from busctl.components.table import ComponentSpec
from busctl.supervisor import Supervisor
from configs.schema import load_config

PROBE = """
import sys

import my_helper

print("helper from", my_helper.__file__, "argv", sys.argv[1:3])
"""


def test_a_component_started_by_the_supervisor_imports_from_code_paths(tmp_path: Path) -> None:
    (tmp_path / "my_code").mkdir()
    (tmp_path / "my_code" / "probe_component.py").write_text(PROBE)  # started as `python -m probe_component`
    (tmp_path / "my_code" / "my_helper.py").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text("task: {code_paths: [my_code]}\n")
    cfg = load_config(config, [f"run_dir={tmp_path / 'run'}", "model.path=unused", "broadcast.method=filesystem"])
    spec = ComponentSpec("probe-0", "probe_component")
    sup = Supervisor(cfg, Console(file=io.StringIO()), table=[spec])
    try:
        sup.prepare()
        sup._spawn(spec)  # the launcher, command line and environment of every component
        assert spec.proc.wait(timeout=60) == 0, sup.log_path(spec).read_text()
    finally:
        sup.shutdown()
    log = sup.log_path(spec).read_text()
    assert f"helper from {tmp_path / 'my_code' / 'my_helper.py'} argv ['--run-dir', '{sup.run_dir}']" in log, log
