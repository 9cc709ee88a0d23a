"""Test helper: the dashboards' queries, Grafana's structural rules, and the metrics the
components export.

- :func:`dashboards` loads ``grafana/dashboards/*.json``; :func:`panel_targets` walks their queries.
- :func:`grafana_problems` lists what would stop Grafana from loading a dashboard as provisioned.
- :func:`exported_metrics` imports every module that defines an ``rlbus_*`` metric (found by
  scanning the packages' sources, so new metrics are picked up) and returns each metric family
  with the sample names Prometheus stores for it.
- :func:`concrete` replaces Grafana's variables so an expression can go to Prometheus directly.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from busctl.metrics_reference import metric_modules

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
METRIC_NAME = re.compile(r"\brlbus_[A-Za-z0-9_]+")
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "heatmap", "table", "text", "piechart", "histogram"}
GRID_WIDTH = 24
SUFFIXES = {  # sample names Prometheus stores per family type (``_created`` left out: never charted)
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def dashboards() -> dict[str, dict]:
    """File stem -> parsed dashboard of every ``grafana/dashboards/*.json``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def panel_targets(dash: dict) -> Iterator[tuple[dict, dict]]:
    """``(panel, target)`` for every query of the dashboard (rows' nested panels included)."""
    for panel in dash.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner, target


SERVICE_ROW = "Service (busctl serve)"
"""The overview's row of ``busctl serve`` panels: their data comes from a service, not from a ``busctl up`` run."""


def row_of(dash: dict, panel: dict) -> str | None:
    """Title of the row ``panel`` sits under (a collapsed row's nested panel or the last row above it)."""
    current = None
    for top in dash.get("panels", []):
        if top.get("type") == "row":
            current = top["title"]
            if panel in top.get("panels", []):
                return current
        if top is panel:
            return current
    return current if panel in dash.get("panels", []) else None


def concrete(expr: str, run: str = ".*", window: str = "30s") -> str:
    """``expr`` with Grafana's ``$run`` and ``$__rate_interval``/``$__interval`` replaced."""
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}"):
        expr = expr.replace(var, window)
    return expr.replace("${run}", run).replace("$run", run)


def metric_names(expr: str) -> set[str]:
    """The ``rlbus_*`` metric names an expression reads."""
    return set(METRIC_NAME.findall(expr))


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
    )


def grafana_problems(dash: dict, datasource_uid: str) -> list[str]:
    """What is wrong with ``dash`` as a provisioned Grafana dashboard (empty: nothing).

    Checks the required fields (uid, title, schemaVersion, panels, time, templating), that panel
    ids are unique, each ``gridPos`` is on the 24-column grid without overlaps, each panel has a
    known type, and every panel, target and template variable uses the Prometheus datasource by
    ``datasource_uid``; every non-row panel has targets with unique refIds and a non-empty expr.
    """
    problems = []
    for key, kind in (
        ("uid", str),
        ("title", str),
        ("schemaVersion", int),
        ("panels", list),
        ("time", dict),
        ("templating", dict),
        ("version", int),
    ):
        if not isinstance(dash.get(key), kind):
            problems.append(f"field {key!r} missing or not {kind.__name__}")
    if problems:
        return problems
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]):
        problems.append(f"uid {dash['uid']!r}: at most 40 of [A-Za-z0-9_-]")
    if dash["schemaVersion"] < 36:
        problems.append(f"schemaVersion {dash['schemaVersion']} predates datasource references by uid (36)")
    want_ds = {"type": "prometheus", "uid": datasource_uid}
    ids, grids = set(), []
    for panel in dash["panels"]:
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in ids:
            problems.append(f"{name}: id missing or not unique")
        ids.add(panel.get("id"))
        if panel.get("type") not in PANEL_TYPES:
            problems.append(f"{name}: unknown type {panel.get('type')!r}")
        if not panel.get("title"):
            problems.append(f"{name}: no title")
        grid = panel.get("gridPos")
        if not isinstance(grid, dict) or not all(isinstance(grid.get(k), int) for k in "hwxy"):
            problems.append(f"{name}: gridPos needs integer h, w, x, y")
        elif grid["w"] < 1 or grid["h"] < 1 or grid["x"] < 0 or grid["y"] < 0 or grid["x"] + grid["w"] > GRID_WIDTH:
            problems.append(f"{name}: gridPos {grid} is off the {GRID_WIDTH}-column grid")
        else:
            problems += [f"{name}: overlaps panel {other}" for other, g in grids if _overlap(grid, g)]
            grids.append((panel.get("id"), grid))
        if panel.get("type") == "row":
            continue
        if panel.get("datasource") != want_ds:
            problems.append(f"{name}: datasource {panel.get('datasource')} is not {want_ds}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{name}: no targets")
        ref_ids = [t.get("refId") for t in targets]
        if len(set(ref_ids)) != len(ref_ids) or not all(ref_ids):
            problems.append(f"{name}: refIds {ref_ids} missing or not unique")
        for target in targets:
            if target.get("datasource") != want_ds:
                problems.append(f"{name} {target.get('refId')}: datasource {target.get('datasource')} is not {want_ds}")
            if not isinstance(target.get("expr"), str) or not target["expr"].strip():
                problems.append(f"{name} {target.get('refId')}: no expr")
    names = [v.get("name") for v in dash["templating"].get("list", [])]
    if len(set(names)) != len(names):
        problems.append(f"template variable names {names} not unique")
    for var in dash["templating"].get("list", []):
        if var.get("type") == "query" and var.get("datasource") != want_ds:
            problems.append(f"variable {var.get('name')}: datasource {var.get('datasource')} is not {want_ds}")
    return problems


def exported_metrics() -> dict[str, set[str]]:
    """Family name -> the sample names Prometheus stores (counter ``x`` -> ``{x_total}``,
    histogram ``h`` -> ``{h_bucket, h_sum, h_count}``, without ``h_sum`` if it has negative
    buckets) of every ``rlbus_`` family in the default registry (the one registry of a component
    process) after importing :func:`metric_modules`; collectors register at import too."""
    from prometheus_client import REGISTRY

    for module in metric_modules():
        importlib.import_module(module)
    out: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("rlbus_"):
            # the samples say what is really exported (no histogram _sum with negative buckets);
            # a labelled family without children has none yet: its type says
            names = {s.name for s in family.samples if not s.name.endswith("_created")}
            out[family.name] = names or {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    return out
