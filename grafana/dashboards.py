"""The rlbus Grafana dashboards: ``python -m grafana.dashboards`` writes them to ``grafana/dashboards/*.json``.

Three dashboards over the Prometheus metrics every component serves (``rlbus_*``), one module each:
:mod:`grafana.overview` (the pipeline), :mod:`grafana.learning` (the policy's training) and :mod:`grafana.weights`
(weight transfer and policy versions), all built with :mod:`grafana.panels`, with a ``run`` variable and the
datasource provisioned as uid ``rlbus-prometheus``. ``tests/observability/test_dashboards.py`` checks that every
``rlbus_*`` metric is on a panel, that every panel's metric exists and that the JSON on disk equals what this
module writes (re-run it after editing); ``tests/observability/test_prometheus_server.py`` runs every expression
against a real Prometheus scraping a short run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grafana.learning import learning
from grafana.overview import overview
from grafana.weights import weights

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
"""Where the dashboard JSON goes (the directory ``provisioning/dashboards/rlbus.yml`` serves)."""

DASHBOARDS = {"overview": overview, "learning": learning, "weights": weights}
"""File stem -> builder of each dashboard."""


def render(dash: dict) -> str:
    """The JSON text of a dashboard as it is written to disk (2-space indent, trailing newline)."""
    return json.dumps(dash, indent=2) + "\n"


def write_all(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every dashboard to ``out_dir/<name>.json``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in DASHBOARDS.items():
        path = out_dir / f"{name}.json"
        path.write_text(render(build()))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m grafana.dashboards [--out DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (default: grafana/dashboards)")
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
