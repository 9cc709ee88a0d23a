"""The rlbus pipeline overview dashboard (``rlbus-overview``): is the pipeline moving, and where does it wait?

Throughput per stage (samples/s, tokens/s), queue depths per topic, where time is spent (busy vs idle per stage,
latencies, trainer step and broadcast time), backpressure (seconds blocked at the HWM), delivery (redeliveries,
rejects, duplicates, peer deaths, restarts), prompt accounting, packer decisions and packing.
"""

from __future__ import annotations

from grafana.panels import (
    WINDOW_NOTE,
    Target,
    agg_by,
    dashboard,
    gauge_by,
    hist_mean,
    increase,
    quantile_targets,
    rate,
    row,
    sel,
    stat,
    timeseries,
)

TRAINER_STAGE = 'stage="trainer"'
RESTARTED = (
    'label_replace(label_replace({sel}, "restarted", "$1", "component", "(.+)"), '
    '"restarted", "$1", "exported_component", "(.+)")'
)
"""The restarted component of ``rlbus_supervisor_restarts_total{component}`` as label ``restarted``:
Prometheus renames the metric's ``component`` to ``exported_component`` when the target has a
``component`` label of its own (``supervisor``) and ``honor_labels`` is off; this reads either."""


def overview() -> dict:
    """The pipeline overview dashboard (module docstring)."""
    stage_busy = agg_by("rlbus_stage_busy_seconds_total", "stage")
    stage_idle = agg_by("rlbus_stage_idle_seconds_total", "stage")
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
            [Target(agg_by("rlbus_stage_samples_total", "stage"), "{{stage}}")],
            description="Samples each stage finished per second (generated, scored, packed, trained).",
        ),
        timeseries(
            "Tokens/s per stage",
            [
                Target(agg_by("rlbus_stage_tokens_total", "stage"), "{{stage}} (completion tokens)"),
                Target(agg_by("rlbus_producer_completion_tokens_total", "component"), "generated {{component}}"),
                Target(
                    gauge_by("rlbus_trainer_tokens_per_s", "component"), "trained (prompt + completion) {{component}}"
                ),
            ],
            description=(
                "Completion tokens of finished samples per stage; the trainer's gauge counts every trained token."
            ),
        ),
        timeseries(
            "Groups/s",
            [
                Target(agg_by("rlbus_producer_groups_total", "component"), "generated {{component}}"),
                Target(agg_by("rlbus_rewards_groups_total", "component"), "scored {{component}}"),
                Target(f"sum({rate('rlbus_packer_steps_total')})", "steps packed"),
            ],
        ),
        timeseries(
            "Bus messages/s per topic",
            [Target(agg_by("rlbus_bus_messages_total", "topic, direction"), "{{topic}} {{direction}}")],
            width=12,
        ),
        timeseries(
            "Bus bytes/s per topic",
            [Target(agg_by("rlbus_bus_bytes_total", "topic, direction"), "{{topic}} {{direction}}")],
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
                Target(gauge_by("rlbus_packer_buffered_groups", "component"), "buffered groups {{component}}"),
                Target(
                    gauge_by("rlbus_packer_unfinished_micro_batches", "component"),
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
                    agg_by("rlbus_producer_endpoint_requests_total", "route, status", increase),
                    "requests {{route}} {{status}}",
                ),
                Target(agg_by("rlbus_producer_endpoint_episodes_total", "outcome", increase), "episodes {{outcome}}"),
                Target(gauge_by("rlbus_producer_endpoint_port"), "port {{component}}"),
            ],
            "short",
            "The producers' /v1/chat/completions and /v1/completions (producers/endpoint.py): requests by route and "
            "status; recorded episodes by outcome (rebased: a turn did not extend the trajectory, the episode ends "
            "before it; "
            "empty: the agent made no request); the port each producer serves on. " + WINDOW_NOTE,
        ),
        timeseries(
            "Trainer: time per phase",
            [
                Target(agg_by("rlbus_trainer_phase_seconds_total", "phase"), "{{phase}}"),
            ],
            "percentunit",
            "Seconds per second: waiting for micro-batches, forward, backward, optimizer, handing weights to the "
            "broadcaster, bookkeeping (trainer/observability/step_timing.py).",
            stack=True,
        ),
        timeseries(
            "Trainer: CPU threads",
            [
                Target(gauge_by("rlbus_trainer_threads"), "threads {{component}}"),
                Target(
                    agg_by("rlbus_trainer_idle_thread_micro_batches_total", "component"),
                    "idle-thread micro-batches/s {{component}}",
                ),
            ],
            "short",
            "torch threads now (trainer.num_threads while the producers sample, trainer.idle_threads once "
            "every step they may sample is buffered: trainer/parallel/threads.py) and the rate of micro-batches run at "
            "idle_threads.",
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
                Target(agg_by("rlbus_bus_blocked_seconds_total", "role, topic"), "{{role}} {{topic}}"),
            ],
            "percentunit",
            "Fraction of time senders waited for credit or outbox room: 1 = blocked all the time.",
        ),
        timeseries(
            "Redeliveries",
            [Target(agg_by("rlbus_bus_redelivered_total", "topic, reason", increase), "{{topic}} {{reason}}")],
            description="Data messages re-sent (peer silent, unreachable, restarted, said goodbye, ack timeout). "
            + WINDOW_NOTE,
        ),
        timeseries(
            "Rejected messages",
            [Target(agg_by("rlbus_bus_rejected_total", "topic, reason", increase), "{{topic}} {{reason}}")],
            description="Received messages dropped as malformed or of an unexpected type. " + WINDOW_NOTE,
        ),
        timeseries(
            "Duplicates dropped",
            [Target(agg_by("rlbus_bus_duplicates_total", "topic", increase), "{{topic}}")],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Bytes held in credit windows",
            [Target(gauge_by("rlbus_bus_queued_bytes", "topic, queue"), "{{topic}} {{queue}}")],
            "bytes",
            "Bytes of the data messages a component holds, per topic and queue (credit windows bounded by "
            "bus.max_inflight_bytes).",
        ),
        timeseries(
            "Courier loop errors and refused metrics clients",
            [
                Target(agg_by("rlbus_bus_courier_errors_total", "component", increase), "courier errors {{component}}"),
                Target(
                    agg_by("rlbus_bus_metrics_tls_refused_total", "component", increase),
                    "metrics TLS refused {{component}}",
                ),
            ],
            description="I/O-loop exceptions (bus.courier.MAX_LOOP_ERRORS in a row fail the component; the supervisor "
            "restarts it) and "
            "metrics clients refused for lacking the client certificate. " + WINDOW_NOTE,
        ),
        timeseries(
            "Peer deaths",
            [Target(agg_by("rlbus_bus_peer_deaths_total", "topic, reason", increase), "{{topic}} {{reason}}")],
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
                Target(agg_by("rlbus_rewards_errors_total", "error", increase), "reward {{error}}"),
                Target(agg_by("rlbus_trainer_skipped_steps_total", "reason", increase), "skipped step {{reason}}"),
                Target(f"sum({increase('rlbus_packer_samples_log_errors_total')})", "samples.jsonl write errors"),
                Target(f"sum({increase('rlbus_packer_resent_steps_total')})", "steps re-sent by a restarted packer"),
                Target(f"sum({increase('rlbus_packer_spool_torn_records_total')})", "torn packer spool records"),
            ],
            description=WINDOW_NOTE,
        ),
        timeseries(
            "Packer decisions (groups/s)",
            [
                Target(agg_by("rlbus_packer_groups_total", "outcome"), "train {{outcome}}"),
                Target(agg_by("rlbus_packer_eval_groups_total", "outcome"), "eval {{outcome}}"),
                Target(f"sum({rate('rlbus_packer_eval_results_total')})", "eval results"),
            ],
        ),
        timeseries(
            "Packing: padding ratio",
            [Target(gauge_by("rlbus_packer_padding_ratio", "component"), "{{component}}")],
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
                Target(agg_by("rlbus_trainer_released_micro_batches_total", "why", increase), "{{why}}"),
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
                Target(agg_by("rlbus_producer_env_errors_total", "error", increase), "env error {{error}}"),
            ],
            "short",
            "Multi-turn tasks (producers/episodes.py): mean model turns per episode, mean seconds of one round of "
            "environment calls, and environment calls that failed (the episode ends with reward 0). " + WINDOW_NOTE,
        ),
        timeseries(
            "Producer: tool calls",
            [
                Target(agg_by("rlbus_producer_tool_calls_total", "tool"), "calls/s {{tool}}"),
                Target(agg_by("rlbus_producer_tool_errors_total", "tool, error"), "errors/s {{tool}} {{error}}"),
                Target(hist_mean("rlbus_producer_episode_tool_calls", "component"), "calls per episode {{component}}"),
                Target(
                    agg_by("rlbus_producer_env_bad_stats_total", "component", increase),
                    "malformed step statistics {{component}}",
                ),
            ],
            "short",
            "Tool calls of multi-turn episodes (producers/turn_metrics.py): calls and failed calls per second by "
            "tool (other: unreadable or not declared in the task's tools; agent tasks count the <tool_call> blocks of "
            "their turns) and error kind, mean calls per episode, and environment step results whose statistics "
            "were malformed (ignored). " + WINDOW_NOTE,
        ),
        row("Service (busctl serve)"),
        timeseries(
            "API requests",
            [Target(agg_by("rlbus_serve_requests_total", "route, code"), "{{route}} {{code}}")],
            "reqps",
            "HTTP requests of the Tinker API per second by route and status (401: refused keys; "
            "retrieve_future counts each long poll). " + WINDOW_NOTE,
        ),
        timeseries(
            "API latency and queue depth",
            [
                *quantile_targets("rlbus_serve_request_seconds", "route", qs=(0.95,), mean=False),
                Target(gauge_by("rlbus_serve_queue_depth", "model"), "queued {{model}}"),
            ],
            "short",
            "p95 seconds to answer a request per route (a long poll waits up to serve.long_poll_s), and the calls "
            "of each model not answered yet (held for their seq_id or running).",
        ),
        timeseries(
            "Trainer API calls",
            [
                Target(agg_by("rlbus_trainer_api_calls_total", "op, outcome"), "{{op}} {{outcome}}"),
                *quantile_targets("rlbus_trainer_api_call_seconds", "op", qs=(0.5,), mean=False),
            ],
            "short",
            "Calls the trainer of busctl serve ran per second by op and outcome (ok, user, server), and the median "
            "seconds of each op. " + WINDOW_NOTE,
        ),
    ]
    return dashboard(
        "rlbus-overview",
        "rlbus: pipeline overview",
        "Throughput, queues, where time goes, backpressure and delivery of an rlbus run.",
        panels,
    )
