"""Config sections of the rollout side: task and dataset, sampling, teacher, filters, online eval.

Part of the run configuration :class:`configs.schema.RunConfig` (which re-exports these classes);
split out to keep one module per concern. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from configs.base import Section


class RewardTermConfig(Section):
    """One reward function of a task and its weight in the total reward."""

    name: str = Field(
        ...,
        min_length=1,
        description=(
            "A registered reward function (tasks/rewards.py), an import path 'package.module:function' (runs the code "
            "it names: configs are trusted), or 'trl:package.module:function' / 'trl_conversational:...' for a "
            "function written for TRL's GRPOTrainer, used as it is (docs/rewards.md)."
        ),
    )
    weight: float = Field(
        1.0,
        allow_inf_nan=False,
        description="Weight of this function's score in the reward: reward = sum of weight * score.",
    )


class DatasetConfig(Section):
    """Where a task's examples come from: local files only, nothing is fetched from a hub."""

    path: str = Field(
        "",
        description=(
            "Training split: a local JSONL or Parquet file (relative to the working directory). Empty: the task's own "
            "data."
        ),
    )
    eval_path: str = Field(
        "", description="Held-out split for online evaluation, same format. Empty: the task's own eval data."
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="File format; auto: by the file suffix (.jsonl/.json, .parquet)."
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Field mapping {the task's field: the dataset's column}, e.g. {question: problem, answer: solution} for "
            "gsm8k."
        ),
    )


class TaskConfig(Section):
    """The training task: dataset, prompt rendering and reward functions (tasks/, one module per task)."""

    name: str = Field(
        "reverse_text",
        description=(
            "A registered task (reverse_text, gsm8k, countdown, reverse_turns, gsm8k_calculator, prompt_file: your "
            "file of prompts, docs/rewards.md), an import path "
            "'package.module:function' returning a tasks.Task, or 'verifiers:MODULE': the verifiers environment "
            "MODULE.load_environment(**task.verifiers_args) (docs/environments.md)."
        ),
    )
    system_prompt: str | None = Field(
        None, description="System message before every prompt; null: the task's default (none for reverse_text)."
    )
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    code_paths: list[str] = Field(
        default_factory=list,
        description=(
            "Folders on the import path of busctl and every component (PYTHONPATH; with every launcher), so the "
            "import paths in task.name, task.rewards, task.agent and rewards.advantage find your modules. Relative "
            "to the config file's folder (set by an override: to the working directory); saved absolute in the run's "
            "config.yaml. Each must exist (on every node) and hold no module an installed package provides."
        ),
    )
    rewards: list[RewardTermConfig] = Field(
        default_factory=list,
        description="Reward functions and weights; each is logged as reward/<name>. Empty: the task's own.",
    )
    num_train_examples: int = Field(
        20_000,
        ge=1,
        description="Training prompts available, at most (cycled if exhausted; file datasets use at most their size).",
    )
    seed: int = Field(0, description="Seed of the training prompts (order, and synthetic tasks' draws).")
    max_turns: int | None = Field(
        None, ge=1, description="Multi-turn tasks: most model turns per episode; null: the task's own."
    )
    env_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description=(
            "Multi-turn tasks: most seconds one environment call may take (the episode then ends with reward 0)."
        ),
    )
    env_procs: int = Field(2, ge=1, description="Multi-turn tasks: environment child processes per producer.")
    agent: str | None = Field(
        None,
        description="Agent task: import path 'package.module:function' of fn(client: openai.OpenAI, example: dict) -> "
        "float, run "
        "isolated once per sample with a client pointed at the producer's OpenAI-compatible endpoint; the recorded "
        "responses "
        "become the sample (docs/environments.md). Applies to the prompts of task.name. null: no agent.",
    )
    verifiers_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "verifiers tasks (task.name 'verifiers:MODULE'): keyword arguments of MODULE.load_environment (JSON "
            "values; they travel with every prompt)."
        ),
    )
    agent_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description=(
            "Agent tasks: most seconds one agent call (a whole episode) may take (the episode then gets reward 0). "
            "Agent calls run in task.env_procs children per producer."
        ),
    )


class TempSchedulerConfig(Section):
    """Sampling temperature as a function of the optimizer step a prompt is issued for."""

    type: Literal["linear", "cosine"] = Field(
        "linear", description="linear or cosine (half period) interpolation over trainer.max_steps."
    )
    start_temperature: float = Field(1.0, gt=0.0, le=10.0, description="Temperature of step 0.")
    end_temperature: float = Field(
        0.7, gt=0.0, le=10.0, description="Temperature of the last step (trainer.max_steps - 1)."
    )


class SamplingConfig(Section):
    """vLLM sampling parameters of the rollout producers."""

    temperature: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="Sampling temperature (when no temp_scheduler); the trainer scores with the same one.",
    )
    temp_scheduler: TempSchedulerConfig | None = Field(
        None,
        description=(
            "Schedule of the temperature over the run (replaces temperature); each sample records its own, and the "
            "trainer divides by it."
        ),
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(32, ge=1, le=65_536, description="Most completion tokens per sample.")
    min_tokens: int = Field(
        0, ge=0, le=65_536, description="End-of-sequence is not sampled before this many completion tokens."
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description=(
            "vLLM repetition penalty (1 = off). The sampler's logprobs include it, the trainer's do not: it adds to "
            "the mismatch ratio."
        ),
    )
    seed: int | None = Field(
        None,
        description=(
            "Per-request sampling seed: the group of prompt index i (n samples) is sampled with seed + i * n (vLLM "
            "seeds sample j with seed + j, so groups never share random numbers; reproducible whatever the batching). "
            "null: the engine's seed stream."
        ),
    )

    @model_validator(mode="after")
    def _min_below_max(self) -> "SamplingConfig":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"sampling.min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")
        return self


class TeacherConfig(Section):
    """An optional teacher model whose per-token logprobs of each completion feed the distillation term."""

    model_path: str = Field(
        "",
        description=(
            "HF model directory or hub id in the local HF cache of the teacher (same tokenizer as the policy). Empty: "
            "no teacher."
        ),
    )
    kv_cache_gib: float = Field(
        0.5, gt=0, le=1024, description="vLLM KV-cache size of each producer's teacher engine, GiB."
    )


class EvalTaskConfig(Section):
    """One eval task: its held-out set and how many rollouts per example."""

    name: str = Field(
        ..., min_length=1, description="A registered task or import path (as task.name); its eval split is used."
    )
    num_examples: int = Field(
        128, ge=1, le=1_000_000, description="Held-out examples evaluated (the first N of the eval split)."
    )
    rollouts_per_example: int = Field(
        1, ge=1, le=1024, description="Completions sampled per example; reward_mean averages them all."
    )
    seed: int = Field(1234, description="Seed of the held-out examples (fixed, so runs compare on the same set).")


class EvalConfig(Section):
    """Online evaluation through the producers and reward workers."""

    enabled: bool = Field(True, description="Evaluate at all.")
    interval: int = Field(
        0,
        ge=0,
        description=(
            "Evaluate the policy every this many steps (versions interval, 2*interval, ...); 0: only at the end."
        ),
    )
    eval_base_model: bool = Field(
        True, description="Also evaluate the unmodified base model once (policy version 0, before any update)."
    )
    tasks: list[EvalTaskConfig] = Field(
        default_factory=list, description="Eval tasks; empty: the training task with the defaults."
    )
    temperature: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="Eval sampling temperature; null: sampling.temperature (or the scheduler's end_temperature).",
    )
    max_tokens: int | None = Field(
        None, ge=1, le=65_536, description="Eval completion tokens; null: sampling.max_tokens."
    )
    timeout_s: float = Field(
        900.0,
        gt=0,
        description=(
            "After the last step the trainer waits this long for the final evaluation before run.done, seconds."
        ),
    )
    only: bool = Field(
        False,
        description="Evaluation without training (what `busctl eval` runs): no trainer; the prompt source issues round "
        "0 "
        "alone (the policy at model.path) and no training prompt; the run ends when every eval task's round-0 result "
        "is in.",
    )

    def round_versions(self, max_steps: int) -> list[int]:
        """The policy versions evaluated: ``{0 if eval_base_model} + {k * interval < max_steps} + {max_steps}``
        ascending (``[0]`` for ``only``, ``[]`` when disabled). ValueError for ``max_steps < 1``."""
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not self.enabled:
            return []
        if self.only:  # busctl eval: the policy at model.path, no training
            return [0]
        rounds = {max_steps}
        if self.eval_base_model:
            rounds.add(0)
        if self.interval > 0:
            rounds.update(range(self.interval, max_steps, self.interval))
        return sorted(rounds)


class GibberishFilterConfig(Section):
    """Flags samples with a sampled token that is both rare (high id) and improbable (prime-rl's gibberish filter)."""

    enabled: bool = Field(False, description="Run the filter.")
    enforce: bool = Field(False, description="Mask flagged samples from the loss; False: only count them.")
    token_id_threshold: int = Field(
        100_000,
        ge=0,
        description="Only tokens with an id above this can be gibberish (BPE vocabularies put rare pieces last).",
    )
    logprob_threshold: float = Field(-12.0, le=0, description="... and whose sampled logprob is below this, nats.")


class RepetitionFilterConfig(Section):
    """Flags samples stuck in a loop: a run of `window` consecutive tokens each sampled with probability above
    `prob_threshold`."""

    enabled: bool = Field(False, description="Run the filter.")
    enforce: bool = Field(False, description="Mask flagged samples from the loss; False: only count them.")
    window: int = Field(256, ge=2, description="Length of the run of near-certain tokens, tokens.")
    prob_threshold: float = Field(
        0.99, gt=0, lt=1, description="A token is near-certain when exp(logprob) exceeds this."
    )


class FiltersConfig(Section):
    """Sample and group filters (Surogate's names)."""

    online_difficulty_filtering: bool = Field(
        False,
        description=(
            "Skip (outcome 'filtered') groups whose rewards are all 0 or all 1: no learning signal; a replacement "
            "prompt is issued."
        ),
    )
    gibberish: GibberishFilterConfig = Field(default_factory=GibberishFilterConfig)
    repetition: RepetitionFilterConfig = Field(default_factory=RepetitionFilterConfig)
    skip_verification: bool = Field(
        False, description="Do not run the reward functions: every reward is 0 (e.g. pure distillation with a teacher)."
    )


class OverlongConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Sec. 3.4, eq. 13): a length
    penalty added to the reward of every training sample (rewards/shaping.py)."""

    buffer_tokens: int = Field(
        ...,
        ge=1,
        le=65_536,
        description=(
            "L_cache: the soft-punishment buffer, tokens. A completion longer than max_tokens - buffer_tokens loses "
            "penalty x (its excess / buffer_tokens)."
        ),
    )
    penalty: float = Field(
        1.0,
        gt=0.0,
        le=1000.0,
        allow_inf_nan=False,
        description="Penalty factor: the reward drops by up to this much (verl's overlong_buffer.penalty_factor).",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description=(
            "L_max: the expected longest completion, tokens; a longer one loses the whole penalty. null: "
            "sampling.max_tokens."
        ),
    )
