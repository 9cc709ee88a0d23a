"""``busctl --help`` (and the parser every busctl command builds first) imports no heavy module:
each command module imports the config schema, the supervisor, the run data and the rest inside
its command functions (busctl/cli.py). Checked in a fresh interpreter, by what ``sys.modules``
holds after the help is printed; the time it takes is measured by ``bench/cli_startup.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

HEAVY = (
    "configs.schema",
    "pydantic",
    "yaml",
    "numpy",
    "torch",
    "zmq",
    "prometheus_client",
    "busctl.supervisor",
    "busctl.run_dir",
    "busctl.run_status",
    "busctl.run_data",
    "busctl.components.placement",
    "busctl.components.table",
)
"""Modules a command may need and ``--help`` must not load (what made it take ~0.7 s)."""

PROBE = """
import json, sys
from busctl.cli import main
try:
    main(["--help"])
except SystemExit as end:
    code = end.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def test_busctl_help_loads_no_heavy_module() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "COLUMNS": "100", "PYTHONPATH": str(REPO_ROOT)},
    ).stdout
    help_text, _, last = out.rstrip("\n").rpartition("\n")
    probe = json.loads(last)
    assert probe["code"] == 0
    for command in ("up", "status", "logs", "down", "scale", "keys", "sbatch", "export", "eval", "report"):
        assert f"\n    {command} " in help_text, command
    loaded = [m for m in probe["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert not loaded, f"busctl --help imported {loaded}: import them inside the command function that needs them"


def test_the_commands_still_find_what_they_import(tmp_path: Path) -> None:
    """The lazy imports resolve: a command that loads a config (``up --dry-run``), one that reads
    a run directory (``status``) and ``eval`` with a missing config each reach their own error."""

    def busctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "busctl", *args], cwd=REPO_ROOT, capture_output=True, text=True)

    dry = busctl("up", "--dry-run", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=3")
    assert dry.returncode == 0 and "max_steps: 3" in dry.stdout, dry.stderr
    status = busctl("status", str(tmp_path / "none"))
    assert status.returncode == 1 and "no run at" in status.stderr
    missing = busctl("eval", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
