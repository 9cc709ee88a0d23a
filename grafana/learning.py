"""The rlbus learning dashboard (``rlbus-learning``): is the policy learning?

Reward (mean, distribution, per reward function), advantages, loss, KL, entropy, masked/clip fractions,
importance ratios, gradient norm, policy lag, stale/filtered drops and online eval per task.
"""

from __future__ import annotations

from grafana.panels import (
    WINDOW_NOTE,
    Target,
    agg_by,
    dashboard,
    gauge_by,
    heatmap,
    increase,
    quantile_targets,
    row,
    timeseries,
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
                Target(gauge_by("rlbus_trainer_reward_mean", "component"), "trained mean {{component}}"),
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
            [Target(gauge_by("rlbus_trainer_reward_term_mean", "reward"), "{{reward}}")],
            description=trainer,
        ),
        timeseries(
            "Overlong shaping and zero-variance groups",
            [
                Target(agg_by("rlbus_rewards_overlong_total", "zone", increase), "samples penalized {{zone}}"),
                Target(
                    agg_by("rlbus_rewards_zero_variance_groups_total", "component", increase),
                    "zero-variance groups {{component}}",
                ),
            ],
            description="Training samples the overlong shaping (rewards.overlong) penalized, inside the buffer (soft) "
            "or past "
            "max_tokens (hard), and training groups whose rewards are all equal (no policy gradient). " + WINDOW_NOTE,
        ),
        timeseries(
            "Advantage",
            quantile_targets("rlbus_rewards_advantage", (), dist, mean=False),
            description="Distribution of the scored samples' advantages.",
        ),
        heatmap("Advantage distribution", "rlbus_rewards_advantage", description=WINDOW_NOTE),
        row("Policy update"),
        timeseries("Loss", [Target(gauge_by("rlbus_trainer_loss"), "{{component}}")], description=trainer),
        timeseries(
            "KL",
            [
                Target(gauge_by("rlbus_trainer_kl"), "k3 KL(infer || train) {{component}}"),
                Target(gauge_by("rlbus_trainer_kl_penalty"), "KL penalty estimator {{component}}"),
                Target(gauge_by("rlbus_trainer_teacher_kl"), "teacher KL {{component}}"),
            ],
            description="Nats. " + trainer,
        ),
        timeseries(
            "Entropy", [Target(gauge_by("rlbus_trainer_entropy"), "{{component}}")], description="Nats. " + trainer
        ),
        timeseries(
            "Masked and clipped fractions",
            [
                Target(gauge_by("rlbus_trainer_masked_frac"), "masked {{component}}"),
                Target(gauge_by("rlbus_trainer_clipfrac"), "clipped {{component}}"),
            ],
            "percentunit",
            "Of the loss tokens. " + trainer,
        ),
        timeseries(
            "Importance ratio pi_train / pi_rollout",
            [
                Target(gauge_by("rlbus_trainer_importance_ratio_mean"), "mean {{component}}"),
                Target(gauge_by("rlbus_trainer_importance_ratio_min"), "min {{component}}"),
                Target(gauge_by("rlbus_trainer_importance_ratio_max"), "max {{component}}"),
            ],
            description=trainer,
        ),
        timeseries(
            "Gradient norm (before clipping)",
            [Target(gauge_by("rlbus_trainer_grad_norm"), "{{component}}")],
            description=trainer,
        ),
        timeseries(
            "Learning rate",
            [Target(gauge_by("rlbus_trainer_lr"), "{{component}}")],
            description="trainer.optim.scheduler's rate of the last step. " + trainer,
        ),
        timeseries(
            "Loss tokens per step",
            [Target(gauge_by("rlbus_trainer_num_loss_tokens"), "{{component}}")],
            description=trainer,
        ),
        row("Off-policy lag and drops"),
        timeseries(
            "Policy lag (steps)",
            [
                *quantile_targets("rlbus_packer_policy_lag_steps", (), (0.5, 0.95, 1.0)),
                Target(gauge_by("rlbus_trainer_policy_lag_mean"), "trained mean {{component}}"),
            ],
            description="Trainer step minus the sample's policy version, per sample the packer accepted.",
        ),
        heatmap("Policy lag distribution", "rlbus_packer_policy_lag_steps", description=WINDOW_NOTE),
        timeseries(
            "Loss tokens by lag",
            [Target(gauge_by("rlbus_trainer_lag_token_frac", "lag"), "lag {{lag}}")],
            "percentunit",
            "Fraction of the last step's loss tokens sampled at each lag (trainer step minus the token's policy "
            "version; a partial rollout's tokens can differ). " + trainer,
        ),
        timeseries(
            "Dropped and filtered",
            [
                Target(
                    agg_by("rlbus_packer_groups_total", "outcome", increase, "sum", 'outcome!="accepted"'),
                    "groups {{outcome}}",
                ),
                Target(agg_by("rlbus_rewards_filtered_total", "filter", increase), "samples flagged {{filter}}"),
            ],
            description=(
                "Groups the packer did not train (stale, filtered, duplicate, ...) and samples a filter flagged. "
            )
            + WINDOW_NOTE,
        ),
        row("Online eval"),
        timeseries(
            "Eval reward per task",
            [
                Target(gauge_by("rlbus_eval_reward_mean", "task"), "mean {{task}}"),
                Target(gauge_by("rlbus_eval_reward_std", "task"), "std {{task}}"),
            ],
            description="Of the last eval round.",
        ),
        timeseries(
            "Eval pass@k", [Target(gauge_by("rlbus_eval_pass_at_k", "task, k"), "{{task}} pass@{{k}}")], "percentunit"
        ),
        timeseries(
            "Eval reward per reward function",
            [Target(gauge_by("rlbus_eval_reward_term_mean", "task, reward"), "{{task}} {{reward}}")],
        ),
        timeseries(
            "Eval completion length",
            [Target(gauge_by("rlbus_eval_completion_len_mean", "task"), "{{task}}")],
            description="Mean completion tokens of the last eval round.",
        ),
        timeseries("Eval round (policy version)", [Target(gauge_by("rlbus_eval_round", "task"), "{{task}}")]),
        timeseries(
            "Eval groups failed",
            [Target(gauge_by("rlbus_eval_num_failed", "task"), "{{task}}")],
            description="Eval groups whose generation failed in the last round.",
        ),
    ]
    return dashboard(
        "rlbus-learning", "rlbus: learning", "Reward, loss, KL, entropy, lag and online eval of an rlbus run.", panels
    )
