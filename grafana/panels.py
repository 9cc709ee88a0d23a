"""Grafana dashboard JSON, built from Python: PromQL helpers, panel builders and a grid layout.

The dashboards (:mod:`grafana.overview`, :mod:`grafana.learning`, :mod:`grafana.weights`) are written with these
helpers so that every panel has the same shape: a Prometheus datasource referenced by uid (:data:`DATASOURCE`,
the uid that ``grafana/provisioning/datasources/rlbus.yml`` provisions) on the panel and on each target,
``refId`` A, B, ... per panel, and a ``gridPos`` on the 24-column grid. Every selector carries ``run=~"$run"``
(the dashboards' ``run`` variable, one value per ``busctl up`` run) and every window is Grafana's
``$__rate_interval``; the Prometheus tests substitute both. Only plain JSON types come out of here, so
``json.dumps`` of a dashboard is deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DATASOURCE_UID = "rlbus-prometheus"
"""The Prometheus datasource's uid, as provisioned by ``provisioning/datasources/rlbus.yml``."""
DATASOURCE = {"type": "prometheus", "uid": DATASOURCE_UID}
RUN_MATCHER = 'run=~"$run"'
"""Label matcher on every selector: the ``run`` label the scrape config puts on each target."""
RATE_INTERVAL = "$__rate_interval"
"""Window of every ``rate``/``increase``: Grafana's at-least-four-scrapes interval."""
WINDOW_NOTE = "Over Grafana's $__rate_interval window."
"""Panel description of a rate over :data:`RATE_INTERVAL`."""
GRID_WIDTH = 24
"""Columns of Grafana's dashboard grid."""


# -- PromQL ---------------------------------------------------------------------------------------


def sel(metric: str, *matchers: str) -> str:
    """Instant selector ``metric{run=~"$run", *matchers}``; matchers are PromQL, e.g. ``'queue="inbox"'``."""
    return f"{metric}{{{', '.join((RUN_MATCHER, *matchers))}}}"


def rate(metric: str, *matchers: str) -> str:
    """``rate(metric{...}[$__rate_interval])``: per-second increase of a counter."""
    return f"rate({sel(metric, *matchers)}[{RATE_INTERVAL}])"


def increase(metric: str, *matchers: str) -> str:
    """``increase(metric{...}[$__rate_interval])``: a counter's increase over the window."""
    return f"increase({sel(metric, *matchers)}[{RATE_INTERVAL}])"


def by(labels: tuple[str, ...] | str) -> str:
    """``by (a, b)`` clause; ``()`` (aggregate everything) for no labels."""
    labels = (labels,) if isinstance(labels, str) else labels
    return f"by ({', '.join(labels)})"


def legend(labels: tuple[str, ...] | str, prefix: str = "") -> str:
    """Grafana legend ``prefix {{a}} {{b}}`` for the labels a series is grouped by."""
    labels = (labels,) if isinstance(labels, str) else labels
    return " ".join([prefix] * bool(prefix) + ["{{" + label + "}}" for label in labels]) or prefix


def agg_by(metric: str, labels: str, fn=rate, agg: str = "sum", *matchers: str) -> str:
    """``agg by (labels) (fn(metric{...}))``."""
    return f"{agg} by ({labels}) ({fn(metric, *matchers)})"


def gauge_by(metric: str, labels: str = "component", agg: str = "max") -> str:
    """A gauge per ``labels`` (``max``: one series per component even if scraped twice)."""
    return f"{agg} by ({labels}) ({sel(metric)})"


def quantile(q: float, histogram: str, labels: tuple[str, ...] | str = ()) -> str:
    """``histogram_quantile(q, ...)`` of a histogram (base name, without ``_bucket``) over the
    window, per ``labels``."""
    labels = (labels,) if isinstance(labels, str) else labels
    return f"histogram_quantile({q}, sum {by(('le', *labels))} ({rate(histogram + '_bucket')}))"


def hist_mean(histogram: str, labels: tuple[str, ...] | str = ()) -> str:
    """Mean observation of a histogram over the window: ``rate(_sum) / rate(_count)`` per ``labels``."""
    return f"sum {by(labels)} ({rate(histogram + '_sum')}) / sum {by(labels)} ({rate(histogram + '_count')})"


@dataclasses.dataclass(frozen=True)
class Target:
    """One PromQL query of a panel.

    Attributes:
        expr: the PromQL expression (may use ``$run`` and ``$__rate_interval``).
        legend: Grafana ``legendFormat``, e.g. ``"{{stage}}"``.
        heatmap: return the series in Grafana's heatmap format (one series per bucket ``le``).
    """

    expr: str
    legend: str = ""
    heatmap: bool = False


def quantile_targets(
    histogram: str, labels: tuple[str, ...] | str = (), qs: tuple[float, ...] = (0.5, 0.95), mean: bool = True
) -> list[Target]:
    """p50/p95 (``qs``) series of a histogram per ``labels``, plus its mean unless ``mean`` is
    False (prometheus-client exports no ``_sum`` for a histogram with negative buckets)."""
    targets = [Target(quantile(q, histogram, labels), legend(labels, f"p{round(q * 100)}")) for q in qs]
    return targets + [Target(hist_mean(histogram, labels), legend(labels, "mean"))] * mean


# -- panels ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Panel:
    """A panel before layout.

    Attributes:
        type: Grafana panel type: ``timeseries``, ``stat``, ``heatmap`` or ``row``.
        title: shown above the panel.
        targets: the queries (none for a ``row``).
        unit: Grafana unit id (``s``, ``percentunit``, ``short``, ``Bps``, ...).
        description: the panel's help text (what to read from it).
        width, height: size in grid units (24 columns wide).
        stack: stack the series (timeseries only).
    """

    type: str
    title: str
    targets: tuple[Target, ...] = ()
    unit: str = "short"
    description: str = ""
    width: int = 8
    height: int = 8
    stack: bool = False


def timeseries(title: str, targets: list[Target], unit: str = "short", description: str = "", **kw: Any) -> Panel:
    """A time-series panel (lines; ``stack=True`` stacks them)."""
    return Panel("timeseries", title, tuple(targets), unit, description, **kw)


def stat(title: str, target: Target, unit: str = "short", description: str = "", **kw: Any) -> Panel:
    """A single-number panel showing the last value of each series."""
    return Panel("stat", title, (target,), unit, description, **{"width": 4, "height": 4, **kw})


def heatmap(title: str, histogram: str, unit: str = "short", description: str = "", **kw: Any) -> Panel:
    """A heatmap of a histogram's bucket increases over time (all series summed per ``le``)."""
    expr = f"sum by (le) ({increase(histogram + '_bucket')})"
    return Panel("heatmap", title, (Target(expr, "{{le}}", heatmap=True),), unit, description, **kw)


def row(title: str) -> Panel:
    """A full-width row header that starts a new line of panels."""
    return Panel("row", title, width=GRID_WIDTH, height=1)


def _target_json(target: Target, ref_id: str) -> dict:
    out = {
        "datasource": dict(DATASOURCE),
        "refId": ref_id,
        "expr": target.expr,
        "legendFormat": target.legend,
        "range": True,
        "instant": False,
    }
    if target.heatmap:
        out["format"] = "heatmap"
    return out


def _panel_json(panel: Panel, panel_id: int, grid: dict) -> dict:
    if panel.type == "row":
        return {"type": "row", "id": panel_id, "title": panel.title, "gridPos": grid, "collapsed": False, "panels": []}
    out: dict = {
        "type": panel.type,
        "id": panel_id,
        "title": panel.title,
        "description": panel.description,
        "datasource": dict(DATASOURCE),
        "gridPos": grid,
        "targets": [_target_json(t, chr(ord("A") + i)) for i, t in enumerate(panel.targets)],
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
    }
    if panel.type == "timeseries":
        out["fieldConfig"]["defaults"]["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if panel.stack else 0,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
        }
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.type == "stat":
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    elif panel.type == "heatmap":
        out["options"] = {
            "calculate": False,
            "yAxis": {"axisPlacement": "left", "unit": panel.unit},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "tooltip": {"show": True, "yHistogram": True},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
        }
    return out


def layout(panels: list[Panel]) -> list[dict]:
    """Panel JSON with ids 1, 2, ... and ``gridPos`` filled left to right, top to bottom; a row
    panel (and a panel that does not fit the line) starts a new line.

    Raises:
        ValueError: a panel is wider than the grid.
    """
    out, x, y, line_height = [], 0, 0, 0
    for panel_id, panel in enumerate(panels, start=1):
        if panel.width > GRID_WIDTH:
            raise ValueError(f"panel {panel.title!r} is {panel.width} wide; the grid has {GRID_WIDTH} columns")
        if panel.type == "row" or x + panel.width > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        out.append(_panel_json(panel, panel_id, {"h": panel.height, "w": panel.width, "x": x, "y": y}))
        x, line_height = x + panel.width, max(line_height, panel.height)
        if panel.type == "row":
            x, y, line_height = 0, y + panel.height, 0
    return out


def run_variable() -> dict:
    """The ``run`` template variable: every value of the ``run`` target label (multi-select, All)."""
    query = "label_values(rlbus_policy_version, run)"
    return {
        "name": "run",
        "label": "run",
        "type": "query",
        "datasource": dict(DATASOURCE),
        "definition": query,
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "sort": 1,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {},
        "hide": 0,
        "options": [],
    }


def dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dict:
    """A complete Grafana dashboard (schema version 39) with the ``run`` variable.

    Args:
        uid: stable dashboard uid (URLs and provisioning use it).
        title: dashboard title.
        description: shown in the dashboard settings.
        panels: in reading order; see :func:`layout`.
    """
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["rlbus"],
        "id": None,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "templating": {"list": [run_variable()]},
        "panels": layout(panels),
    }
