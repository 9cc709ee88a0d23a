"""The rlbus Grafana dashboards, defined in Python; ``python -m grafana.dashboards`` writes them.

Three dashboards over the Prometheus metrics every component serves (``rlbus_*``, see
``docs/ARCHITECTURE.md``), all with a ``run`` variable (the ``run`` label of the run's scrape
config) and the datasource provisioned as uid ``rlbus-prometheus``:

- ``rlbus-overview``: the pipeline. Throughput per stage (samples/s, tokens/s), queue depths per
  topic, where time is spent (busy vs idle per stage, latencies, trainer step and broadcast time),
  backpressure (seconds blocked at the HWM), delivery (redeliveries, rejects, duplicates, peer
  deaths, restarts), prompt accounting, packer decisions and packing.
- ``rlbus-learning``: reward (mean, distribution, per reward function), advantages, loss, KL,
  entropy, masked/clip fractions, importance ratios, gradient norm, policy lag, stale/filtered
  drops and online eval per task.
- ``rlbus-weights``: broadcast and transfer time, fallbacks, each producer's weight-update time
  and the policy version per component.

Every ``rlbus_*`` metric of the components appears on some panel, and every panel queries only
metrics that exist: ``tests/observability/test_dashboards.py`` checks both against the
prometheus-client registry, and that ``grafana/dashboards/*.json`` equals what this module writes
(re-run it after editing). ``tests/observability/test_prometheus_server.py`` runs every
expression against a real Prometheus scraping a short run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grafana.panels import (
    Target,
    dashboard,
    heatmap,
    hist_mean,
    increase,
    quantile_targets,
    rate,
    row,
    sel,
    stat,
    timeseries,
)

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
"""Where the dashboard JSON goes (the directory ``provisioning/dashboards/rlbus.yml`` serves)."""
WINDOW_NOTE = "Over Grafana's $__rate_interval window."
TRAINER_STAGE = 'stage="trainer"'
TRAINER_ROLE, PRODUCER_ROLE = 'role="trainer"', 'role="producer"'
"""Matchers on the ``role`` label the run's scrape config puts on each target."""
RESTARTED = (
    'label_replace(label_replace({sel}, "restarted", "$1", "component", "(.+)"), '
    '"restarted", "$1", "exported_component", "(.+)")'
)
"""The restarted component of ``rlbus_supervisor_restarts_total{component}`` as label ``restarted``:
Prometheus renames the metric's ``component`` to ``exported_component`` when the target has a
``component`` label of its own (``supervisor``) and ``honor_labels`` is off; this reads either."""


def _by(metric: str, labels: str, fn=rate, agg: str = "sum", *matchers: str) -> str:
    """``agg by (labels) (fn(metric{...}))``."""
    return f"{agg} by ({labels}) ({fn(metric, *matchers)})"


def _gauge(metric: str, labels: str = "component", agg: str = "max") -> str:
    """A gauge per ``labels`` (``max``: one series per component even if scraped twice)."""
    return f"{agg} by ({labels}) ({sel(metric)})"


def overview() -> dict:
    """The pipeline overview dashboard (module docstring)."""
    stage_busy = _by("rlbus_stage_busy_seconds_total", "stage")
    stage_idle = _by("rlbus_stage_idle_seconds_total", "stage")
    panels = [
        row("At a glance"),
        stat("Policy version (max)", Target(f"max({sel('rlbus_policy_version')})")),
        stat("Trained samples/s", Target(f"sum({rate('rlbus_stage_samples_total', TRAINER_STAGE)})")),
        stat("Optimizer steps packed", Target(f"sum({sel('rlbus_packer_steps_total')})")),
        stat("Restarts", Target(f"sum({sel('rlbus_supervisor_restarts_total')})")),
        stat("Unresolved prompts", Target(f"sum({sel('rlbus_accounting_unresolved')})")),
        stat(
            "Issuing gated by the trainer",
            Target(f"max({sel('rlbus_prompt_source_gated')})"),
            description="1 while the prompt source waits for the trainer (max_async_level reached).",
        ),
        row("Throughput"),
        timeseries(
            "Samples/s per stage",
            [Target(_by("rlbus_stage_samples_total", "stage"), "{{stage}}")],
            description="Samples each stage finished per second (generated, scored, packed, trained).",
        ),
        timeseries(
            "Tokens/s per stage",
            [
                Target(_by("rlbus_stage_tokens_total", "stage"), "{{stage}} (completion tokens)"),
                Target(_by("rlbus_producer_completion_tokens_total", "component"), "generated {{component}}"),
                Target(
                    _gauge("rlbus_trainer_tokens_per_s", "component"), "trained (prompt + completion) {{component}}"
                ),
            ],
            description="Completion tokens of finished samples per stage; the trainer's gauge counts every trained token.",
        ),
        timeseries(
            "Groups/s",
            [
                Target(_by("rlbus_producer_groups_total", "component"), "generated {{component}}"),
                Target(_by("rlbus_rewards_groups_total", "component"), "scored {{component}}"),
                Target(f"sum({rate('rlbus_packer_steps_total')})", "steps packed"),
            ],
        ),
        timeseries(
            "Bus messages/s per topic",
            [Target(_by("rlbus_bus_messages_total", "topic, direction"), "{{topic}} {{direction}}")],
            width=12,
        ),
        timeseries(
            "Bus bytes/s per topic",
            [Target(_by("rlbus_bus_bytes_total", "topic, direction"), "{{topic}} {{direction}}")],
            "Bps",
            width=12,
        ),
        row("Queues"),
        timeseries(
            "Queue depth per topic",
            [
                Target(
                    f"sum by (role, topic, queue) ({sel('rlbus_bus_queued_messages')})", "{{role}} {{topic}} {{queue}}"
                ),
            ],
            description="inbox: received, not yet taken; outbox_not_taken: sent, not taken downstream; "
            "outbox_unfinished: not done downstream.",
            width=12,
        ),
        timeseries(
            "Packer buffers",
            [
                Target(_gauge("rlbus_packer_buffered_groups", "component"), "buffered groups {{component}}"),
                Target(
                    _gauge("rlbus_packer_unfinished_micro_batches", "component"),
                    "unfinished micro-batches {{component}}",
                ),
            ],
            width=6,
        ),
        timeseries(
            "Prompt accounting",
            [
                Target(f"sum({sel('rlbus_accounting_issued_total')})", "issued"),
                Target(f"sum by (outcome) ({sel('rlbus_accounting_outcomes_total')})", "{{outcome}}"),
                Target(f"sum({sel('rlbus_accounting_unresolved')})", "unresolved"),
            ],
            description="Distinct prompts issued in the run, their outcomes, and those without one yet.",
            width=6,
        ),
        row("Where time is spent"),
        timeseries(
            "Stage utilisation (busy fraction)",
            [
                Target(f"{stage_busy} / ({stage_busy} + {stage_idle})", "{{stage}}"),
            ],
            "percentunit",
            "Busy: at least one item in work. The stage near 1 while the others idle is the bottleneck.",
        ),
        timeseries(
            "Busy and idle seconds/s per stage",
            [
                Target(stage_busy, "busy {{stage}}"),
                Target(stage_idle, "idle {{stage}}"),
            ],
            "s",
            "Summed over the stage's replicas: 2 replicas busy all the time show 2 s/s.",
            stack=True,
        ),
        timeseries(
            "Latency per item and stage",
            quantile_targets("rlbus_stage_latency_seconds", "stage"),
            "s",
            "Producer, rewards, packer: one group; trainer: one optimizer step.",
        ),
        timeseries(
            "Producer: generation and teacher time per group",
            [
                *quantile_targets("rlbus_producer_group_seconds", "component"),
                Target(hist_mean("rlbus_producer_teacher_seconds", "component"), "teacher mean {{component}}"),
            ],
            "s",
        ),
        timeseries(
            "Rewards: scoring time per group", quantile_targets("rlbus_rewards_score_seconds", "component"), "s"
        ),
        timeseries(
            "Producer: OpenAI-compatible endpoint",
            [
                Target(
                    _by("rlbus_producer_endpoint_requests_total", "route, status", increase),
                    "requests {{route}} {{status}}",
                ),
                Target(_by("rlbus_producer_endpoint_episodes_total", "outcome", increase), "episodes {{outcome}}"),
                Target(_gauge("rlbus_producer_endpoint_port"), "port {{component}}"),
            ],
            "short",
            "The producers' /v1/chat/completions and /v1/completions (producers/endpoint.py): requests by route and "
            "status; recorded episodes by outcome (rebased: a turn did not extend the trajectory, the episode ends before it; "
            "empty: the agent made no request); the port each producer serves on. " + WINDOW_NOTE,
        ),
        timeseries(
            "Trainer: time per phase",
            [
                Target(_by("rlbus_trainer_phase_seconds_total", "phase"), "{{phase}}"),
            ],
            "percentunit",
            "Seconds per second: waiting for micro-batches, forward, backward, optimizer, handing weights to the broadcaster, bookkeeping (trainer/observability/step_timing.py).",
            stack=True,
        ),
        timeseries(
            "Trainer: CPU threads",
            [
                Target(_gauge("rlbus_trainer_threads"), "threads {{component}}"),
                Target(
                    _by("rlbus_trainer_idle_thread_micro_batches_total", "component"),
                    "idle-thread micro-batches/s {{component}}",
                ),
            ],
            "short",
            "torch threads now (trainer.num_threads while the producers sample, trainer.idle_threads once "
            "every step they may sample is buffered: trainer/parallel/threads.py) and the rate of micro-batches run at idle_threads.",
        ),
        timeseries(
            "Trainer: step and broadcast time",
            [
                *quantile_targets("rlbus_trainer_step_seconds"),
                Target(hist_mean("rlbus_trainer_weight_broadcast_seconds"), "broadcast mean"),
            ],
            "s",
            "Step time includes waiting for data; broadcast: the trainer thread's part of publishing weights.",
        ),
        row("Backpressure and delivery"),
        timeseries(
            "Blocked at the HWM (s/s) per topic",
            [
                Target(_by("rlbus_bus_blocked_seconds_total", "role, topic"), "{{role}} {{topic}}"),
            ],
            "percentunit",
            "Fraction of time senders waited for credit or outbox room: 1 = blocked all the time.",
        ),
        timeseries(
            "Redeliveries",
            [Target(_by("rlbus_bus_redelivered_total", "topic, reason", increase), "{{topic}} {{reason}}")],
            description="Data messages re-sent (peer silent, unreachable, restarted, said goodbye, ack timeout). "
            + WINDOW_NOTE,
        ),
        timeseries(
            "Rejected messages",
            [Target(_by("rlbus_bus_rejected_total", "topic, reason", increase), "{{topic}} {{reason}}")],
            description="Received messages dropped as malformed or of an unexpected type. " + WINDOW_NOTE,
        ),
        timeseries(
            "Duplicates dropped",
            [Target(_by("rlbus_bus_duplicates_total", "topic", increase), "{{topic}}")],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Bytes held in credit windows",
            [Target(_gauge("rlbus_bus_queued_bytes", "topic, queue"), "{{topic}} {{queue}}")],
            "bytes",
            "Bytes of the data messages a component holds, per topic and queue (credit windows bounded by bus.max_inflight_bytes).",
        ),
        timeseries(
            "Courier loop errors and refused metrics clients",
            [
                Target(_by("rlbus_bus_courier_errors_total", "component", increase), "courier errors {{component}}"),
                Target(
                    _by("rlbus_bus_metrics_tls_refused_total", "component", increase),
                    "metrics TLS refused {{component}}",
                ),
            ],
            description="I/O-loop exceptions (bus.courier.MAX_LOOP_ERRORS in a row fail the component; the supervisor restarts it) and "
            "metrics clients refused for lacking the client certificate. " + WINDOW_NOTE,
        ),
        timeseries(
            "Peer deaths",
            [Target(_by("rlbus_bus_peer_deaths_total", "topic, reason", increase), "{{topic}} {{reason}}")],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Restarts per component",
            [
                Target(
                    f"max by (restarted) ({RESTARTED.format(sel=sel('rlbus_supervisor_restarts_total'))})",
                    "{{restarted}}",
                ),
            ],
            description="Components restarted by the supervisor (cumulative).",
        ),
        row("Prompts, failures and packing"),
        timeseries(
            "Prompt source",
            [
                Target(f"sum({increase('rlbus_prompt_source_prompts_total')})", "prompts sent"),
                Target(f"sum({increase('rlbus_prompt_source_replaced_total')})", "replacements owed"),
                Target(f"sum({increase('rlbus_prompt_source_reissued_total')})", "re-issued after a restart"),
                Target(f"sum({increase('rlbus_prompt_source_eval_rounds_total')})", "eval rounds"),
            ],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Failures",
            [
                Target(f"sum({increase('rlbus_producer_groups_failed_total')})", "generation failed"),
                Target(_by("rlbus_rewards_errors_total", "error", increase), "reward {{error}}"),
                Target(_by("rlbus_trainer_skipped_steps_total", "reason", increase), "skipped step {{reason}}"),
                Target(f"sum({increase('rlbus_packer_samples_log_errors_total')})", "samples.jsonl write errors"),
                Target(f"sum({increase('rlbus_packer_resent_steps_total')})", "steps re-sent by a restarted packer"),
                Target(f"sum({increase('rlbus_packer_spool_torn_records_total')})", "torn packer spool records"),
            ],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Packer decisions (groups/s)",
            [
                Target(_by("rlbus_packer_groups_total", "outcome"), "train {{outcome}}"),
                Target(_by("rlbus_packer_eval_groups_total", "outcome"), "eval {{outcome}}"),
                Target(f"sum({rate('rlbus_packer_eval_results_total')})", "eval results"),
            ],
        ),
        timeseries(
            "Packing: padding ratio",
            [Target(_gauge("rlbus_packer_padding_ratio", "component"), "{{component}}")],
            "percentunit",
            "Padding tokens / all tokens of the last emitted step's micro-batches.",
        ),
        timeseries(
            "Packing: micro-batches per step",
            quantile_targets("rlbus_packer_micro_batches_per_step"),
            description="Micro-batches of each emitted optimizer step.",
        ),
        timeseries(
            "Trainer: micro-batches released",
            [
                Target(_by("rlbus_trainer_released_micro_batches_total", "why", increase), "{{why}}"),
            ],
            description="Released to the packer (done): covered by a checkpoint, or re-sent for a covered step. "
            + WINDOW_NOTE,
        ),
        row("Multi-turn episodes"),
        timeseries(
            "Producer: multi-turn episodes",
            [
                Target(hist_mean("rlbus_producer_episode_turns", "component"), "model turns per episode {{component}}"),
                Target(hist_mean("rlbus_producer_env_seconds", "component"), "env call round, s {{component}}"),
                Target(_by("rlbus_producer_env_errors_total", "error", increase), "env error {{error}}"),
            ],
            "short",
            "Multi-turn tasks (producers/episodes.py): mean model turns per episode, mean seconds of one round of "
            "environment calls, and environment calls that failed (the episode ends with reward 0). " + WINDOW_NOTE,
        ),
        timeseries(
            "Producer: tool calls",
            [
                Target(_by("rlbus_producer_tool_calls_total", "tool"), "calls/s {{tool}}"),
                Target(_by("rlbus_producer_tool_errors_total", "tool, error"), "errors/s {{tool}} {{error}}"),
                Target(hist_mean("rlbus_producer_episode_tool_calls", "component"), "calls per episode {{component}}"),
                Target(
                    _by("rlbus_producer_env_bad_stats_total", "component", increase),
                    "malformed step statistics {{component}}",
                ),
            ],
            "short",
            "Tool calls of multi-turn episodes (producers/turn_metrics.py): calls and failed calls per second by "
            "tool (other: unreadable or not declared in the task's tools; agent tasks count the <tool_call> blocks of "
            "their turns) and error kind, mean calls per episode, and environment step results whose statistics "
            "were malformed (ignored). " + WINDOW_NOTE,
        ),
    ]
    return dashboard(
        "rlbus-overview",
        "rlbus: pipeline overview",
        "Throughput, queues, where time goes, backpressure and delivery of an rlbus run.",
        panels,
    )


def learning() -> dict:
    """The learning dashboard (module docstring)."""
    dist = (0.1, 0.5, 0.9)
    trainer = "Of the last optimizer step (trainer gauge)."
    panels = [
        row("Reward"),
        timeseries(
            "Reward",
            [
                Target(_gauge("rlbus_trainer_reward_mean", "component"), "trained mean {{component}}"),
                *quantile_targets("rlbus_rewards_reward", (), dist),
            ],
            description="The trainer's mean over the last step, and the distribution of every scored sample's reward.",
        ),
        heatmap(
            "Reward distribution",
            "rlbus_rewards_reward",
            description="Scored samples per reward bucket. " + WINDOW_NOTE,
        ),
        timeseries(
            "Reward per reward function",
            [Target(_gauge("rlbus_trainer_reward_term_mean", "reward"), "{{reward}}")],
            description=trainer,
        ),
        timeseries(
            "Overlong shaping and zero-variance groups",
            [
                Target(_by("rlbus_rewards_overlong_total", "zone", increase), "samples penalized {{zone}}"),
                Target(
                    _by("rlbus_rewards_zero_variance_groups_total", "component", increase),
                    "zero-variance groups {{component}}",
                ),
            ],
            description="Training samples the overlong shaping (rewards.overlong) penalized, inside the buffer (soft) or past "
            "max_tokens (hard), and training groups whose rewards are all equal (no policy gradient). " + WINDOW_NOTE,
        ),
        timeseries(
            "Advantage",
            quantile_targets("rlbus_rewards_advantage", (), dist, mean=False),
            description="Distribution of the scored samples' advantages.",
        ),
        heatmap("Advantage distribution", "rlbus_rewards_advantage", description=WINDOW_NOTE),
        row("Policy update"),
        timeseries("Loss", [Target(_gauge("rlbus_trainer_loss"), "{{component}}")], description=trainer),
        timeseries(
            "KL",
            [
                Target(_gauge("rlbus_trainer_kl"), "k3 KL(infer || train) {{component}}"),
                Target(_gauge("rlbus_trainer_kl_penalty"), "KL penalty estimator {{component}}"),
                Target(_gauge("rlbus_trainer_teacher_kl"), "teacher KL {{component}}"),
            ],
            description="Nats. " + trainer,
        ),
        timeseries(
            "Entropy", [Target(_gauge("rlbus_trainer_entropy"), "{{component}}")], description="Nats. " + trainer
        ),
        timeseries(
            "Masked and clipped fractions",
            [
                Target(_gauge("rlbus_trainer_masked_frac"), "masked {{component}}"),
                Target(_gauge("rlbus_trainer_clipfrac"), "clipped {{component}}"),
            ],
            "percentunit",
            "Of the loss tokens. " + trainer,
        ),
        timeseries(
            "Importance ratio pi_train / pi_rollout",
            [
                Target(_gauge("rlbus_trainer_importance_ratio_mean"), "mean {{component}}"),
                Target(_gauge("rlbus_trainer_importance_ratio_min"), "min {{component}}"),
                Target(_gauge("rlbus_trainer_importance_ratio_max"), "max {{component}}"),
            ],
            description=trainer,
        ),
        timeseries(
            "Gradient norm (before clipping)",
            [Target(_gauge("rlbus_trainer_grad_norm"), "{{component}}")],
            description=trainer,
        ),
        timeseries(
            "Learning rate",
            [Target(_gauge("rlbus_trainer_lr"), "{{component}}")],
            description="trainer.optim.scheduler's rate of the last step. " + trainer,
        ),
        timeseries(
            "Loss tokens per step",
            [Target(_gauge("rlbus_trainer_num_loss_tokens"), "{{component}}")],
            description=trainer,
        ),
        row("Off-policy lag and drops"),
        timeseries(
            "Policy lag (steps)",
            [
                *quantile_targets("rlbus_packer_policy_lag_steps", (), (0.5, 0.95, 1.0)),
                Target(_gauge("rlbus_trainer_policy_lag_mean"), "trained mean {{component}}"),
            ],
            description="Trainer step minus the sample's policy version, per sample the packer accepted.",
        ),
        heatmap("Policy lag distribution", "rlbus_packer_policy_lag_steps", description=WINDOW_NOTE),
        timeseries(
            "Loss tokens by lag",
            [Target(_gauge("rlbus_trainer_lag_token_frac", "lag"), "lag {{lag}}")],
            "percentunit",
            "Fraction of the last step's loss tokens sampled at each lag (trainer step minus the token's policy "
            "version; a partial rollout's tokens can differ). " + trainer,
        ),
        timeseries(
            "Dropped and filtered",
            [
                Target(
                    _by("rlbus_packer_groups_total", "outcome", increase, "sum", 'outcome!="accepted"'),
                    "groups {{outcome}}",
                ),
                Target(_by("rlbus_rewards_filtered_total", "filter", increase), "samples flagged {{filter}}"),
            ],
            description="Groups the packer did not train (stale, filtered, duplicate, ...) and samples a filter flagged. "
            + WINDOW_NOTE,
        ),
        row("Online eval"),
        timeseries(
            "Eval reward per task",
            [
                Target(_gauge("rlbus_eval_reward_mean", "task"), "mean {{task}}"),
                Target(_gauge("rlbus_eval_reward_std", "task"), "std {{task}}"),
            ],
            description="Of the last eval round.",
        ),
        timeseries(
            "Eval pass@k", [Target(_gauge("rlbus_eval_pass_at_k", "task, k"), "{{task}} pass@{{k}}")], "percentunit"
        ),
        timeseries(
            "Eval reward per reward function",
            [Target(_gauge("rlbus_eval_reward_term_mean", "task, reward"), "{{task}} {{reward}}")],
        ),
        timeseries(
            "Eval completion length",
            [Target(_gauge("rlbus_eval_completion_len_mean", "task"), "{{task}}")],
            description="Mean completion tokens of the last eval round.",
        ),
        timeseries("Eval round (policy version)", [Target(_gauge("rlbus_eval_round", "task"), "{{task}}")]),
        timeseries(
            "Eval groups failed",
            [Target(_gauge("rlbus_eval_num_failed", "task"), "{{task}}")],
            description="Eval groups whose generation failed in the last round.",
        ),
    ]
    return dashboard(
        "rlbus-learning", "rlbus: learning", "Reward, loss, KL, entropy, lag and online eval of an rlbus run.", panels
    )


def weights() -> dict:
    """The weights dashboard (module docstring)."""
    panels = [
        row("Versions"),
        timeseries(
            "Policy version per component",
            [Target(_gauge("rlbus_policy_version", "component"), "{{component}}")],
            description="The version each component last saw or uses: producers lag the trainer by at most max_async_level.",
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
            description="The trainer's policy version minus each producer's: at most max_async_level (+1 while an update is in flight).",
            width=12,
        ),
        timeseries(
            "Producer: last weight update",
            [
                Target(_gauge("rlbus_producer_weight_update_last_seconds", "component"), "{{component}}"),
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
            description="Attempts to re-form the broadcast group (a producer joined or a member died); failed: the members "
            "that never acknowledged take the filesystem method. " + WINDOW_NOTE,
        ),
        timeseries(
            "Producers per weight method",
            [
                Target(f"max by (method) ({sel('rlbus_trainer_weight_members', TRAINER_ROLE)})", "{{method}}"),
            ],
            description="Producers in the current broadcast group, and producers taking weights by the filesystem method.",
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
