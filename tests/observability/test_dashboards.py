"""The Grafana dashboards and provisioning, without a pipeline:

- ``grafana/dashboards/*.json`` is what ``python -m grafana.dashboards`` writes (fails when stale);
- each dashboard is valid as provisioned Grafana JSON (fields, unique panel ids, grid, refIds,
  datasource by the provisioned uid);
- every ``rlbus_*`` metric a component exports appears on a panel, and every metric a panel
  queries is exported;
- the provisioning files and ``docker-compose.yml`` parse and point at each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grafana import dashboards as generator
from grafana.panels import DATASOURCE_UID
from tests.observability.grafana_json import (
    GRAFANA,
    dashboards,
    exported_metrics,
    grafana_problems,
    metric_modules,
    metric_names,
    panel_targets,
)

EXPECTED = {"overview", "learning", "weights"}


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def datasource() -> dict:
    (source,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "rlbus.yml")["datasources"]
    return source


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return exported_metrics()


def all_exprs() -> dict[str, str]:
    """``"dashboard / panel title / refId"`` -> expr of every panel query."""
    return {
        f"{name} / {panel['title']} / {target['refId']}": target["expr"]
        for name, dash in dashboards().items()
        for panel, target in panel_targets(dash)
    }


def test_generated_json_is_up_to_date() -> None:
    on_disk = {p.stem: p.read_text() for p in (GRAFANA / "dashboards").glob("*.json")}
    assert set(generator.DASHBOARDS) == EXPECTED
    assert set(on_disk) == EXPECTED, "grafana/dashboards/ holds other files than the generator writes"
    stale = [name for name, build in generator.DASHBOARDS.items() if on_disk[name] != generator.render(build())]
    assert not stale, f"grafana/dashboards/{stale} are stale: run `python -m grafana.dashboards`"


def test_generator_writes_every_dashboard(tmp_path: Path) -> None:
    paths = generator.write_all(tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{n}.json" for n in EXPECTED)
    assert all(p.read_text() == (GRAFANA / "dashboards" / p.name).read_text() for p in paths)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_is_valid_grafana_json(name: str, datasource: dict) -> None:
    dash = dashboards()[name]
    assert grafana_problems(dash, datasource["uid"]) == []
    assert dash["uid"] == f"rlbus-{name}"
    assert len(list(panel_targets(dash))) >= 10


def test_structural_check_catches_broken_dashboards(datasource: dict) -> None:
    """The check itself finds each kind of fault (a check that passes everything proves nothing)."""
    faults = {
        "id missing or not unique": lambda d: d["panels"][1].update(id=d["panels"][2]["id"]),
        "is not {'type'": lambda d: d["panels"][1].update(datasource={"type": "prometheus", "uid": "other"}),
        "refIds": lambda d: d["panels"][1]["targets"].append(dict(d["panels"][1]["targets"][0])),
        "gridPos needs": lambda d: d["panels"][1].pop("gridPos"),
        "overlaps": lambda d: d["panels"][2].update(gridPos=dict(d["panels"][1]["gridPos"])),
        "field 'schemaVersion'": lambda d: d.pop("schemaVersion"),
    }
    assert [p["type"] for p in generator.weights()["panels"][:3]] == ["row", "timeseries", "timeseries"]
    for message, break_it in faults.items():
        broken = generator.weights()
        break_it(broken)
        problems = grafana_problems(broken, datasource["uid"])
        assert any(message in p for p in problems), (message, problems)


def test_every_dashboard_uses_the_provisioned_datasource(datasource: dict) -> None:
    assert datasource["uid"] == DATASOURCE_UID and datasource["type"] == "prometheus"
    for name, dash in dashboards().items():
        for panel, target in panel_targets(dash):
            assert target["datasource"]["uid"] == panel["datasource"]["uid"] == datasource["uid"], (
                name,
                panel["title"],
            )


def test_metric_modules_are_found() -> None:
    modules = set(metric_modules())
    assert {
        "telemetry.metrics",
        "busctl.supervisor",
        "producers.proc",
        "prompts.proc",
        "prompts.source",
        "rewards.proc",
        "rewards.worker",
        "packer.proc",
        "trainer.proc",
        "trainer.publish",
        "trainer.trainer",
        "packer.eval_log",
    } <= modules


def test_every_metric_appears_on_a_panel(exported: dict[str, set[str]]) -> None:
    used = set().union(*(metric_names(e) for e in all_exprs().values()))
    missing = sorted(family for family, names in exported.items() if not names & used)
    assert not missing, f"metrics on no panel: {missing}"


def test_every_panel_metric_exists(exported: dict[str, set[str]]) -> None:
    known = set().union(*exported.values())
    unknown = {where: sorted(metric_names(expr) - known) for where, expr in all_exprs().items()}
    unknown = {where: names for where, names in unknown.items() if names}
    assert not unknown, f"panels query metrics that no component exports: {unknown}"


def test_no_placeholder_series() -> None:
    """A panel shows real series: no ``or vector(0)`` fallbacks."""
    assert not [where for where, expr in all_exprs().items() if "vector(" in expr]


def test_dashboard_provider_serves_the_dashboards_dir() -> None:
    (provider,) = load_yaml(GRAFANA / "provisioning" / "dashboards" / "rlbus.yml")["providers"]
    assert provider["type"] == "file"
    compose = load_yaml(GRAFANA / "docker-compose.yml")
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./dashboards"] == provider["options"]["path"]
    assert mounts["./provisioning"] == "/etc/grafana/provisioning"
    for host in mounts:
        assert (GRAFANA / host).is_dir(), f"docker-compose.yml mounts {host}, which does not exist under grafana/"
    assert (GRAFANA / "provisioning" / "datasources" / "rlbus.yml").is_file()


def test_compose_runs_prometheus_on_the_run_scrape_config(datasource: dict) -> None:
    services = load_yaml(GRAFANA / "docker-compose.yml")["services"]
    assert {"prometheus", "grafana"} <= set(services)
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert services["grafana"]["image"].startswith("grafana/grafana")
    prom = services["prometheus"]
    args = dict(a.removeprefix("--").split("=", 1) for a in prom["command"] if "=" in a)
    run_mount = next(v for v in prom["volumes"] if v.startswith("${RUN_DIR"))
    target = run_mount.rsplit(":", 2)[-2] if run_mount.endswith(":ro") else run_mount.rsplit(":", 1)[-1]
    assert args["config.file"] == f"{target}/prometheus.yml"  # the file busctl up writes into RUN_DIR
    assert "web.enable-lifecycle" in [a.removeprefix("--") for a in prom["command"]]  # reload after a rewrite
    # the run's scrape targets are 127.0.0.1: Prometheus must share the host's network, and
    # Grafana reaches it where it listens
    assert prom["network_mode"] == services["grafana"]["network_mode"] == "host"
    assert datasource["url"] == f"http://{args['web.listen-address']}"
