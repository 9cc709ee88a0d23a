"""The metrics reference, generated from the Prometheus registry: ``python -m busctl.metrics_reference``.

Imports every rlbus module that defines Prometheus metrics (:data:`PACKAGES`), adds the collectors components
create at run time (:data:`RUNTIME_COLLECTORS`), and renders ``docs/metrics.md``: one table per component
prefix with each family's name, type, labels, unit, help and serving roles. Run it in a fresh interpreter (it
hooks the default registry before the metric modules are imported); ``--check`` fails when the committed file
is stale (``tests/docs/test_metrics_reference.py``).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY

from trainer.observability.step_keys import STEP_KEYS

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "metrics.md"
"""Where ``python -m busctl.metrics_reference`` writes the reference."""

PACKAGES = (
    "telemetry",
    "bus",
    "busctl",
    "prompts",
    "producers",
    "rewards",
    "packer",
    "trainer",
    "broadcaster",
    "service",
)
"""Packages searched for modules that define metrics."""

_DEFINES = re.compile(
    r"^from prometheus_client(\.core)? import .*\b(Counter|Gauge|Histogram|Summary|MetricFamily)", re.M
)

SERVED_BY = (
    ("busctl.supervisor", "", "supervisor"),
    ("telemetry.", "rlbus_stage_", "producer, rewards, packer, trainer (label `stage`)"),
    ("telemetry.", "", "every process"),
    ("prompts.", "", "prompt-source"),
    ("producers.", "", "producer"),
    ("rewards.", "", "rewards"),
    ("packer.", "", "packer"),
    ("trainer.", "", "trainer"),
    ("broadcaster.", "", "trainer"),
    ("service.", "", "serve"),
)
"""``(module prefix, metric name prefix, roles)``: the first row whose prefixes match says which
processes (by their ``role`` scrape label) serve a family."""

SECTIONS = {
    "bus": "Bus traffic, per topic and direction (`send`, `recv`), from every process's sockets "
    "(`bus/sockets.py`, `bus/inbox.py`, `bus/outbox.py`). Queue depth and redeliveries exist on data topics only.",
    "stage": "Pipeline stages (`telemetry.metrics.StageMeter`): throughput, latency and where time goes. "
    "Busy time runs while the stage has at least one item in work, idle time otherwise, so "
    "`rate(rlbus_stage_busy_seconds_total[1m])` is a process's utilisation (summed over a stage's "
    "replicas: its busy processes); the stage near full while the others idle is the bottleneck. "
    "Samples and tokens count finished samples and "
    "their completion tokens; latency is per item (a group; for the trainer one optimizer step).",
    "policy": "The policy version a process works with: the trainer's latest weights, the version a producer "
    "applied, the prompt source's gate (the lowest version every producer applied); 0 elsewhere.",
    "supervisor": "`busctl up` itself (component `supervisor`).",
    "serve": "The HTTP API of `busctl serve` (`service/`, docs/service.md): requests, latency, queue depth per model.",
    "prompt_source": "Prompt issue and gating (`prompts/proc.py`, `prompts/source.py`).",
    "accounting": "The prompt ledger: every issued prompt ends in one outcome (`docs/DELIVERY.md`).",
    "producer": "Rollout producers (`producers/proc.py`): generation and weight updates.",
    "rewards": "Reward workers (`rewards/proc.py`, `rewards/worker.py`): rewards, advantages, "
    "failures of reward functions, filters.",
    "packer": "The packer (`packer/proc.py`): staleness filter, policy lag, packing, samples log.",
    "trainer": "The trainer, rank 0 (`trainer/proc.py`, `trainer/observability/gauges.py`, "
    "`trainer/observability/step_timing.py`, "
    "`trainer/parallel/threads.py`, `trainer/publish.py`): the last step's loss and statistics as gauges "
    "(also in `metrics.jsonl`), step time by phase, CPU threads, weight transfer times.",
    "eval": "Online evaluation (`packer/eval_log.py`): the last eval round per eval task.",
}
"""Component prefix (``rlbus_<prefix>_...``) -> the introduction of its table, in document order."""

UNITS = ("seconds", "bytes", "ratio", "steps", "tokens", "samples", "messages", "groups", "prompts")
"""Name suffixes read as the unit (base units, or what a count counts)."""


@dataclass(frozen=True)
class Family:
    """One metric family as documented: ``name`` as exported (counters with ``_total``), ``values``: label name ->
    values pre-initialised before any event, ``module``: the module that registers it."""

    name: str
    kind: str
    labels: tuple[str, ...]
    values: dict[str, tuple[str, ...]]
    help: str
    module: str
    buckets: tuple[float, ...] = ()

    @property
    def section(self) -> str:
        """The component prefix of :data:`SECTIONS` the name starts with.

        Raises:
            ValueError: a name outside every prefix (add its component to :data:`SECTIONS`).
        """
        for prefix in sorted(SECTIONS, key=len, reverse=True):
            if self.name.startswith(f"rlbus_{prefix}_"):
                return prefix
        raise ValueError(
            f"{self.name} ({self.module}): no component prefix; add it to SECTIONS in busctl/metrics_reference.py"
        )

    @property
    def unit(self) -> str:
        """The unit its name ends with (``_total`` dropped; ``_per_s``: per second), else the one
        word after the help text's last comma (``..., nats``), else ``""``."""
        stem = self.name.removesuffix("_total")
        if stem.endswith("_per_s"):
            return stem.removesuffix("_per_s").rpartition("_")[2] + "/s"
        named = next((u for u in UNITS if stem.endswith("_" + u)), "")
        tail = self.help.rpartition(",")[2].strip() if "," in self.help else ""
        return named or (tail if tail.isalpha() else "")

    @property
    def served_by(self) -> str:
        """Roles whose processes serve it (see :data:`SERVED_BY`)."""
        for module, name, roles in SERVED_BY:
            if self.module.startswith(module) and self.name.startswith(name):
                return roles
        raise ValueError(f"{self.name}: module {self.module} is in no row of SERVED_BY in busctl/metrics_reference.py")


def metric_modules() -> list[str]:
    """Modules of :data:`PACKAGES` whose source imports a metric type from prometheus_client."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if _DEFINES.search(path.read_text()):
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def _stage_meters() -> None:
    from telemetry.metrics import STAGES, StageMeter

    _KEEP.extend(StageMeter(stage) for stage in STAGES)  # each stage's process makes one at set-up


_KEEP: list = []
"""Runtime objects kept alive while the registry is walked (stage meters are held weakly)."""


def _bus_topics() -> None:
    from telemetry.metrics import declare_topic
    from bus.topics import TOPICS

    for spec in TOPICS.values():
        for direction in ("send", "recv"):
            declare_topic(spec.name, direction, reliable=spec.reliable)


RUNTIME_COLLECTORS = {"telemetry.metrics.StageMeter": _stage_meters, "telemetry.metrics.declare_topic": _bus_topics}
"""What components create at run time (not at import), made here too: ``{the code: maker}``; a
maker adds series (label values) to the default registry's collectors."""


def collect_families() -> list[Family]:
    """Every ``rlbus_`` family of this process after importing :func:`metric_modules` and making
    :data:`RUNTIME_COLLECTORS`, sorted by name.

    Raises:
        RuntimeError: a metric module was imported before this call (its collectors' modules
            would be unknown): run in a fresh interpreter.
    """
    modules = metric_modules()
    early = [m for m in modules if m in sys.modules]
    if early:
        raise RuntimeError(
            f"{early} imported before collect_families(): "
            "run `python -m busctl.metrics_reference` in a fresh interpreter"
        )
    owner: dict[int, str] = {}
    register = REGISTRY.register

    def recording_register(collector) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("prometheus_client"):
            frame = frame.f_back
        owner[id(collector)] = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        register(collector)

    REGISTRY.register = recording_register  # the instance attribute shadows the method
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        del REGISTRY.register
    for make in RUNTIME_COLLECTORS.values():
        make()
    collectors = [(c, owner.get(id(c), "?")) for c in REGISTRY._collector_to_names]
    families: dict[str, Family] = {}
    for collector, module in collectors:
        for metric in collector.collect():
            if metric.name.startswith("rlbus_"):
                family = _family(collector, metric, module)
                seen = families.setdefault(family.name, family)
                for label, values in family.values.items():  # the same family from several registries
                    seen.values[label] = tuple(sorted({*seen.values.get(label, ()), *values}))
    return sorted(families.values(), key=lambda f: f.name)


def _family(collector, metric, module: str) -> Family:
    labels = tuple(getattr(collector, "_labelnames", ()))
    values: dict[str, set[str]] = {}
    for sample in metric.samples:
        for key, value in sample.labels.items():
            if key != "le":
                values.setdefault(key, set()).add(value)
    if not labels:
        labels = tuple(sorted(values))
    name = metric.name + "_total" if metric.type == "counter" else metric.name
    bounds = (
        tuple(b for b in getattr(collector, "_upper_bounds", ()) if b != float("inf"))
        if metric.type == "histogram"
        else ()
    )
    return Family(
        name,
        metric.type,
        labels,
        {k: tuple(sorted(v)) for k, v in values.items()},
        metric.documentation,
        module,
        bounds,
    )


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _bounds(buckets: tuple[float, ...]) -> str:
    return ", ".join(f"{b:g}" for b in buckets) + ", +Inf"


def section_markdown(prefix: str, families: list[Family]) -> str:
    """One component's table, its histogram buckets and its pre-initialised label values."""
    lines = [
        f"## `rlbus_{prefix}_*`",
        "",
        SECTIONS[prefix],
        "",
        "| name | type | labels | unit | served by | help |",
        "|---|---|---|---|---|---|",
    ]
    for f in families:
        labels = ", ".join(f"`{label}`" for label in f.labels) or "-"
        lines.append(f"| `{f.name}` | {f.kind} | {labels} | {f.unit or '-'} | {f.served_by} | {_cell(f.help)} |")
    histograms = [f for f in families if f.kind == "histogram"]
    if histograms:
        lines += ["", "Histogram buckets (`le`, upper bounds):", ""]
        lines += [f"- `{f.name}`: {_bounds(f.buckets)}" for f in histograms]
    known = [(f, label) for f in families for label in f.labels if f.values.get(label)]
    if known:
        lines += ["", "Label values that exist (at 0) before any event:", ""]
        lines += [f"- `{f.name}` `{label}`: " + ", ".join(f"`{v}`" for v in f.values[label]) for f, label in known]
    return "\n".join(lines) + "\n"


HEADER = """\
# Metrics reference

<!-- Generated by `python -m busctl.metrics_reference` from the Prometheus registry of the rlbus
modules; do not edit by hand. tests/docs/test_metrics_reference.py fails when this file is stale. -->

Every rlbus process has one Prometheus registry and serves it on its own port. Names are
`rlbus_<component>_<what>_<unit>`: base units (seconds, bytes, ratios), counters end in `_total`,
latencies and lags are histograms (`_bucket`, `_sum`, `_count`; counters and histograms also
export prometheus-client's `_created` timestamps). Labelled counters are created with their known
label values, so their series exist (at 0) from the first scrape and `rate()` works from the start.

## Endpoints

Each component (`bus/component.py`, `telemetry.metrics.serve_metrics`) serves on `127.0.0.1:PORT` (on
several nodes, `busctl up --launcher slurm|ray`: on its node's address, `RLBUS_NODE_ADDRESS`; it
reports host and port in its ready handshake and `prometheus.yml` lists it there):

- `GET /metrics`: the registry in the Prometheus text format.
- `GET /health`: JSON `{"status": "ok" | "unhealthy", "pid", "uptime_s", "component", "phase",
  "policy_version"}`, HTTP 200 while the component's phase is `running` or `done`, else 503
  (`phase` is `starting` during set-up, `failed` after an error).
- anything else: 404.

With `bus.transport: tcp` and `bus.curve_keys_dir` (the CurveZMQ-authenticated bus) both are
HTTPS only, with client certificates required (`telemetry/tls.py`; `busctl keys` makes the CA,
one server certificate per host and the client certificate in `DIR/tls`): a client must present
`DIR/tls/client.crt` (+ `client.key`) and can check the server against `DIR/tls/ca.crt` and the
host it connects to (each host's certificate names its addresses). The supervisor's poller and
`prometheus.yml` (`scheme: https`, `tls_config`) do;
a connection without the certificate is dropped in the handshake and counted in
`rlbus_bus_metrics_tls_refused_total`.

`busctl up` serves its own registry (the `supervisor` target: restarts, and the bus counters
of its handshake and control sockets) on a port of its own, `metrics_port` in `status.json`,
with a `/health` of its own: `{"component": "supervisor", "state", "step", "components_live",
"components"}`, 503 once the run failed.

Ports: `metrics.base_port` 0 (the default) lets each process pick a free port; otherwise
component k of the table uses `base_port + k`. `busctl status RUN_DIR` lists every component's
port (and the supervisor's), and `RUN_DIR/status.json` holds them.

## Scrape configuration

`busctl up` writes `RUN_DIR/prometheus.yml` at start and rewrites it whenever a component gets a
new port (restart, `busctl scale`): job `rlbus`, one static config per process, labelled `run`
(the config's `name`), `component` (the process, e.g. `producer-0`) and `role` (`hub`,
`trainer`, `packer`, `rewards`, `producer`, `prompt-source`, or `supervisor` for `busctl up`).
Dashboards group by `component` or `role`. For a run with one reward worker it reads like this
(ports differ per run):

```yaml
{scrape_example}```

Point a Prometheus at it (`prometheus --config.file=RUN_DIR/prometheus.yml`), or use the
Prometheus + Grafana stack of `grafana/` (see `docs/quickstart.md`). At the end of a run every
process's exposition is saved to `RUN_DIR/metrics_final/<component>.prom` (and
`supervisor.prom`).

The "served by" column names the `role` of the processes whose `/metrics` carries the family
(its values change only where the work happens; a module imported elsewhere shows its metrics
there at 0). Useful queries:

```
sum by (stage) (rate(rlbus_stage_samples_total[1m]))          samples/s per stage
sum by (stage) (rate(rlbus_stage_tokens_total[1m]))           completion tokens/s per stage
sum by (stage) (rate(rlbus_stage_busy_seconds_total[1m]))     busy processes per stage
sum by (topic, queue) (rlbus_bus_queued_messages)             queue depth per data topic
sum by (topic) (rate(rlbus_bus_blocked_seconds_total[1m]))    backpressure: senders waiting at the bound
sum by (topic, reason) (rate(rlbus_bus_redelivered_total[5m])) redeliveries
histogram_quantile(0.9, sum by (le) (rate(rlbus_packer_policy_lag_steps_bucket[5m])))  policy lag p90
```
"""


STEP_KEYS_INTRO = """\
Every key of a trainer step's metrics: the `metrics.jsonl` record of each step (`{"step": ..., **metrics}`,
rank 0), the `trainer.step` message's `metrics`, and the `rlbus_trainer_<key>` gauge where the gauge column
names one. From `trainer/observability/step_keys.py`; `<name>` marks a family of keys. A key an option turns off
is absent."""


def step_keys_markdown() -> str:
    """The table of a trainer step's metrics keys (:data:`trainer.observability.step_keys.STEP_KEYS`)."""
    lines = ["## Trainer step records (`metrics.jsonl`)", "", STEP_KEYS_INTRO, "", "| key | gauge | meaning |"]
    lines.append("|---|---|---|")
    for key, row in STEP_KEYS.items():
        gauge = f"`rlbus_trainer_{key}`" if row.gauge else "-"
        lines.append(f"| `{key}` | {gauge} | {_cell(row.help)} |")
    return "\n".join(lines) + "\n"


def _scrape_example() -> str:
    import yaml

    from busctl.run_status import scrape_config

    targets = [
        (name, role, "127.0.0.1", port)
        for name, role, port in [
            ("hub", "hub", 40001),
            ("trainer", "trainer", 40002),
            ("packer", "packer", 40003),
            ("rewards-0", "rewards", 40004),
            ("producer-0", "producer", 40005),
            ("prompt-source", "prompt-source", 40006),
            ("supervisor", "supervisor", 40000),
        ]
    ]
    return yaml.safe_dump(scrape_config("reverse_text", targets), sort_keys=False)


def render(families: list[Family]) -> str:
    """The whole reference (markdown) for ``families``.

    Raises:
        ValueError: a family outside :data:`SECTIONS` or :data:`SERVED_BY`, or a query in the
            header naming a metric that does not exist.
    """
    names = {f.name for f in families}
    header = HEADER.replace("{scrape_example}", _scrape_example())
    for mentioned in set(re.findall(r"\brlbus_[a-z_]+[a-z]", header)):
        if mentioned not in names and mentioned.removesuffix("_bucket") not in names:
            raise ValueError(f"the metrics reference's text names {mentioned}, which no module defines")
    by_section: dict[str, list[Family]] = {}
    for f in families:
        f.served_by
        by_section.setdefault(f.section, []).append(f)
    toc = ["## Components", ""] + [
        f"- [`rlbus_{p}_*`](#rlbus_{p}_): {len(by_section[p])} famil{'y' if len(by_section[p]) == 1 else 'ies'}"
        for p in SECTIONS
        if p in by_section
    ]
    toc.append("- [Trainer step records (`metrics.jsonl`)](#trainer-step-records-metricsjsonl)")
    sections = [section_markdown(p, by_section[p]) for p in SECTIONS if p in by_section]
    return "\n".join([header, "\n".join(toc) + "\n", *sections, step_keys_markdown()])


def main(argv: list[str] | None = None) -> int:
    """Write the reference to ``docs/metrics.md`` (or ``--out``); ``--check`` only compares and
    exits 1 when the file is stale; ``--list`` prints the family names found."""
    parser = argparse.ArgumentParser(prog="python -m busctl.metrics_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOC_PATH, help="output file (default: docs/metrics.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from a fresh rendering")
    parser.add_argument("--list", action="store_true", help="print every rlbus_ family name and exit")
    ns = parser.parse_args(argv)
    families = collect_families()
    if ns.list:
        print("\n".join(f.name for f in families))
        return 0
    from configs.reference import write_or_check

    return write_or_check(
        ns.out,
        render(families),
        check=ns.check,
        command="python -m busctl.metrics_reference",
        note=f" ({len(families)} metric families)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
