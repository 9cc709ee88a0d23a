"""The control plane of rlbus, named after its CLI ``busctl``: it starts, watches, heals, scales
and stops the component processes of a run, and shows and reports on them.

Invariants: nothing in ``bus/`` (the message bus) imports from here; components never import
from here either (they talk to the supervisor only through bus messages). Modules:
:mod:`busctl.cli` (the ``busctl`` commands), :mod:`busctl.supervisor` (the process table's
lifecycle), :mod:`busctl.healing` (the pure restart policy), :mod:`busctl.scaling`
(``busctl scale``), :mod:`busctl.component_table` (what runs and how it is launched),
:mod:`busctl.run_status` (``status.json``, ``prometheus.yml``, run-dir files),
:mod:`busctl.scrape` and :mod:`busctl.live` (metrics polling, terminal display),
:mod:`busctl.report` and :mod:`busctl.report_plots` (``busctl report``),
:mod:`busctl.metrics_reference` (``docs/metrics.md``).
"""
