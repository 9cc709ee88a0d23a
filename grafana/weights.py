"""The rlbus weights dashboard (``rlbus-weights``): how the policy's weights reach the producers.

Broadcast and transfer time, fallbacks, each producer's weight-update time and the policy version per component.
"""

from __future__ import annotations

from grafana.panels import (
    WINDOW_NOTE,
    Target,
    dashboard,
    gauge_by,
    increase,
    quantile_targets,
    row,
    sel,
    timeseries,
)

TRAINER_ROLE, PRODUCER_ROLE = 'role="trainer"', 'role="producer"'
"""Matchers on the ``role`` label the run's scrape config puts on each target."""


def weights() -> dict:
    """The weights dashboard (module docstring)."""
    panels = [
        row("Versions"),
        timeseries(
            "Policy version per component",
            [Target(gauge_by("rlbus_policy_version", "component"), "{{component}}")],
            description=(
                "The version each component last saw or uses: producers lag the trainer by at most max_async_level."
            ),
            width=12,
        ),
        timeseries(
            "Producers behind the trainer (versions)",
            [
                Target(
                    f"scalar(max({sel('rlbus_policy_version', TRAINER_ROLE)})) - "
                    f"max by (component) ({sel('rlbus_policy_version', PRODUCER_ROLE)})",
                    "{{component}}",
                ),
            ],
            description=(
                "The trainer's policy version minus each producer's: at most max_async_level (+1 while an update is in "
                "flight)."
            ),
            width=12,
        ),
        timeseries(
            "Producer: last weight update",
            [
                Target(gauge_by("rlbus_producer_weight_update_last_seconds", "component"), "{{component}}"),
            ],
            "s",
            "Pause + load + resume of the last update; its version is the producer's rlbus_policy_version.",
            width=12,
        ),
        row("Broadcast"),
        timeseries(
            "Trainer: publish time",
            quantile_targets("rlbus_trainer_weight_broadcast_seconds"),
            "s",
            "Time the trainer thread spends publishing new weights.",
        ),
        timeseries(
            "Transfer time",
            quantile_targets("rlbus_trainer_weight_transfer_seconds"),
            "s",
            "A background broadcast, start to every producer received.",
        ),
        timeseries(
            "Broadcast fallbacks",
            [Target(f"sum({increase('rlbus_trainer_broadcast_fallbacks_total')})", "fallbacks")],
            description="Broadcasts that raised with no group to re-form (sharded weights); the trainer then uses the "
            "filesystem method. " + WINDOW_NOTE,
        ),
        timeseries(
            "Weight group re-forms",
            [
                Target(f"sum by (outcome) ({increase('rlbus_trainer_weight_group_reforms_total')})", "{{outcome}}"),
            ],
            description="Attempts to re-form the broadcast group (a producer joined or a member died); failed: the "
            "members "
            "that never acknowledged take the filesystem method. " + WINDOW_NOTE,
        ),
        timeseries(
            "Producers per weight method",
            [
                Target(f"max by (method) ({sel('rlbus_trainer_weight_members', TRAINER_ROLE)})", "{{method}}"),
            ],
            description=(
                "Producers in the current broadcast group, and producers taking weights by the filesystem method."
            ),
        ),
        row("Producers"),
        timeseries(
            "Producer: weight update time",
            quantile_targets("rlbus_producer_weight_update_seconds", "component"),
            "s",
            "Pause + load + resume per update.",
            width=12,
        ),
        timeseries(
            "Producer: update waited for eval",
            quantile_targets("rlbus_producer_update_eval_wait_seconds", "component"),
            "s",
            "Time an update waited for in-flight eval groups.",
            width=12,
        ),
    ]
    return dashboard("rlbus-weights", "rlbus: weights", "Weight broadcast and policy versions of an rlbus run.", panels)
