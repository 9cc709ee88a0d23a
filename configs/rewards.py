"""The ``rewards`` section: reward workers, the advantage estimator, overlong shaping and the failure shares of
user functions past which ``busctl up`` warns and stops the run (docs/rewards.md, "When a reward function fails").
"""

from __future__ import annotations

from pydantic import Field, model_validator

from configs.base import Section
from configs.rollout import OverlongConfig


class RewardsConfig(Section):
    """Reward/advantage workers; the failure shares past which busctl up warns and stops."""

    replicas: int = Field(2, ge=1, le=256, description="Number of reward worker processes.")
    advantage: str = Field(
        "grpo",
        description="Group advantage estimator (rewards/advantages.py): 'grpo' (r - mean) / (std + eps); 'drgrpo' r - "
        "mean; "
        "'rloo' r_i - mean of the others; 'length_weighted' r - token-weighted mean reward; or an import path "
        "'package.module:function' to fn(rewards [G] float64, completion_lengths [G] int64) -> [G] (imported at worker "
        "start).",
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std in the 'grpo' advantage denominator.")
    isolate: bool = Field(
        True,
        description="Run the reward function in child processes: one that raises, hangs past timeout_s, crashes or "
        "returns "
        "NaN scores that sample 0 (counted by error) and the worker goes on. False: call it in-process (tests, "
        "benchmarks).",
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description=(
            "Most seconds one reward call may take (isolate only); past it the child is killed and replaced, the "
            "sample scores 0."
        ),
    )
    num_procs: int = Field(
        2,
        ge=1,
        le=64,
        description=(
            "Child processes per reward worker (isolate only); the samples of a group are scored across them in "
            "parallel."
        ),
    )
    overlong: OverlongConfig | None = Field(
        None,
        description=(
            "DAPO soft overlong punishment of long training completions, e.g. {buffer_tokens: 64, penalty: 1.0}; its "
            "score is the reward term 'overlong'. null: off."
        ),
    )

    max_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Stop the run (busctl up exits 1, naming the function, its error and share) once a reward function, "
            "environment or agent fails on more than this share of its last error_window calls. 1: never stop."
        ),
    )
    warn_error_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description=(
            "Print a console warning (function, error, first message, share) once a reward function, environment "
            "or agent fails on more than this share of its last error_window calls."
        ),
    )
    error_window: int = Field(
        64,
        ge=8,
        le=100_000,
        description=(
            "Recent calls per function (and per reward worker or producer) the two shares are taken over; a "
            "function may warn after a quarter of this many calls and stop the run after all of them."
        ),
    )

    @model_validator(mode="after")
    def _advantage_known(self) -> "RewardsConfig":
        # The names of rewards.advantages.ADVANTAGE_NAMES (not imported: this module stays numpy-free).
        names = ("grpo", "drgrpo", "rloo", "length_weighted")
        module, _, attr = self.advantage.partition(":")
        if self.advantage not in names and not (module and attr):
            raise ValueError(
                f"rewards.advantage={self.advantage!r} is unknown; use one of {', '.join(names)} "
                "or an import path 'package.module:function'"
            )
        if self.warn_error_fraction > self.max_error_fraction:
            raise ValueError(
                f"rewards.warn_error_fraction={self.warn_error_fraction} is above "
                f"rewards.max_error_fraction={self.max_error_fraction}: the run would stop before it warned"
            )
        return self
