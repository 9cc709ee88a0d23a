"""docs/metrics.md: generated from the Prometheus registry, lists every rlbus_ family, never stale.

The generator hooks the default registry before importing the metric modules, so it runs in a
fresh interpreter (a subprocess), as a user runs it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Imports every process's entry module (the real component table), adds a stage meter as the
# stage processes do at set-up, and prints the exported name of each rlbus_ family in the default
# registry, through prometheus_client's public collect().
LIST_FAMILIES = """
import json
from prometheus_client import REGISTRY
from busctl.components.table import component_table
from configs.schema import RunConfig
import importlib
serve = RunConfig(serve={"only": True})  # busctl serve's table: its trainer and API process
for module in sorted({s.module for c in (RunConfig(), serve) for s in component_table(c)} | {"busctl.supervisor"}):
    importlib.import_module(module)
from telemetry.metrics import StageMeter
StageMeter("producer")  # what each stage's process registers in its setup (busy/idle seconds)
names = set()
for metric in REGISTRY.collect():
    if metric.name.startswith("rlbus_"):
        names.add(metric.name + "_total" if metric.type == "counter" else metric.name)
print(json.dumps(sorted(names)))
"""


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def registry_families() -> list[str]:
    proc = _run("-c", LIST_FAMILIES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _documented(text: str) -> set[str]:
    return set(re.findall(r"^\| `(rlbus_[a-z_]+)` \|", text, re.M))


def test_committed_metrics_reference_is_fresh() -> None:
    proc = _run("-m", "busctl.metrics_reference", "--check")
    assert proc.returncode == 0, (
        f"docs/metrics.md is stale (a metric was added, renamed or changed): run `python -m busctl.metrics_reference` "
        f"and commit the result\n{proc.stderr[-2000:]}"
    )


def test_every_family_of_every_process_is_listed(registry_families: list[str]) -> None:
    documented = _documented((DOCS / "metrics.md").read_text())
    assert len(registry_families) > 50
    missing = sorted(set(registry_families) - documented)
    assert not missing, f"served by a process but not in docs/metrics.md: {missing}"


def test_rows_have_type_labels_unit_and_server() -> None:
    text = (DOCS / "metrics.md").read_text()
    rows = {
        m.group(1): [c.strip() for c in m.group(2).split(" | ")]
        for m in re.finditer(r"^\| `(rlbus_[a-z_]+)` \| (.*) \|$", text, re.M)
    }
    assert rows["rlbus_bus_messages_total"][:4] == ["counter", "`topic`, `direction`", "messages", "every process"]
    assert rows["rlbus_stage_latency_seconds"][0] == "histogram"
    assert rows["rlbus_stage_latency_seconds"][2] == "seconds"
    assert rows["rlbus_supervisor_restarts_total"][3] == "supervisor"
    assert rows["rlbus_trainer_step_seconds"][3] == "trainer"
    for name, (kind, _labels, _unit, served, help_text) in rows.items():
        assert kind in ("counter", "gauge", "histogram"), name
        assert name.endswith("_total") == (kind == "counter"), f"{name}: counters and only counters end in _total"
        assert served and help_text, name
    assert "- `rlbus_bus_rejected_total` `reason`: " in text  # pre-initialised label values


def test_metric_names_in_the_docs_exist(registry_families: list[str]) -> None:
    """Every rlbus_ name the documentation mentions is a real family (``rlbus_x_*`` patterns and
    histogram ``_bucket``/``_sum``/``_count`` series included)."""
    known = set(registry_families)
    wrong = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for name in set(re.findall(r"rlbus_[a-z0-9_]*\*?", path.read_text())):
            if name.endswith(("*", "_")):
                ok = any(k.startswith(name.rstrip("*")) for k in known)
            else:
                ok = name in known or re.sub(r"_(bucket|sum|count)$", "", name) in known
            if not ok:
                wrong.append(f"{path.relative_to(ROOT)}: {name}")
    assert not wrong, f"documented metric names that no process serves: {sorted(wrong)}"


def test_check_flag_detects_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "metrics.md"
    out.write_text("stale\n")
    proc = _run("-m", "busctl.metrics_reference", "--out", str(out), "--check")
    assert proc.returncode == 1 and "python -m busctl.metrics_reference" in proc.stderr
