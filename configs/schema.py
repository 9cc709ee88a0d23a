"""The typed run configuration of rlbus (pydantic), loaded from YAML with dotted overrides.

A run is one :class:`RunConfig`; each component reads its own section. Every field has a
description and bounds; unknown keys are errors (``extra="forbid"``), and the error message names
the dotted key and what to change. The rollout-side sections (task, sampling, teacher, filters,
eval) live in :mod:`configs.rollout`, the shared base class in :mod:`configs.base`. This module
imports no torch, so the supervisor and tests can load configs cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from configs.base import Section
from configs.rollout import EvalConfig, FiltersConfig, SamplingConfig, TaskConfig, TeacherConfig

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = CONFIG_DIR / "reverse_text.yaml"


class ModelConfig(Section):
    """The policy model."""

    path: str = Field("", description="Local HF model directory. Empty: build (or reuse from the cache) rlbus's tiny reverse-text policy.")
    cache_dir: str = Field(".cache/rlbus", description="Where the tiny policy is built and cached (relative to the working directory).")
    sft_steps: int = Field(300, ge=0, le=100_000, description="Most supervised warm-start steps of the tiny policy.")
    sft_target_loss: float = Field(1.7, ge=0, description="The warm start stops once its training loss (nats/token) falls below this: deliberately partial, so that RL has room.")
    max_model_len: int = Field(256, ge=16, le=131_072, description="Longest prompt + completion, tokens.")


class ProducersConfig(Section):
    """Rollout producers (one vLLM AsyncLLM engine each)."""

    replicas: int = Field(1, ge=1, le=64, description="Number of producer processes.")
    group_size: int = Field(8, ge=1, le=1024, description="Completions per prompt (G).")
    max_concurrent_groups: int = Field(8, ge=1, le=4096, description="Groups a producer generates at once.")
    kv_cache_gib: float = Field(1.0, gt=0, le=1024, description="vLLM KV-cache size per engine, GiB.")
    seed: int = Field(0, description="vLLM sampling seed (producer i uses seed + i).")
    max_replicas: int = Field(
        8, ge=1, le=64, description="Most producers the run can have (`busctl scale producers=N` up to this): reward workers connect to this many rollouts endpoints."
    )

    @model_validator(mode="after")
    def _room_for_replicas(self) -> "ProducersConfig":
        if self.replicas > self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) > max_replicas ({self.max_replicas}); raise max_replicas")
        return self


class RewardsConfig(Section):
    """Reward/advantage workers."""

    replicas: int = Field(2, ge=1, le=256, description="Number of reward worker processes.")
    advantage: str = Field(
        "grpo",
        description="Group advantage estimator (rewards/advantages.py): 'grpo' (r - mean) / (std + eps); 'drgrpo' r - mean; "
        "'rloo' r_i - mean of the others; 'length_weighted' r - token-weighted mean reward; or an import path "
        "'package.module:function' to fn(rewards [G] float64, completion_lengths [G] int64) -> [G] (imported at worker start).",
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std in the 'grpo' advantage denominator.")
    isolate: bool = Field(
        True,
        description="Run the reward function in child processes: one that raises, hangs past timeout_s, crashes or returns "
        "NaN scores that sample 0 (counted by error) and the worker goes on. False: call it in-process (tests, benchmarks).",
    )
    timeout_s: float = Field(
        5.0, gt=0, le=3600, description="Most seconds one reward call may take (isolate only); past it the child is killed and replaced, the sample scores 0."
    )
    num_procs: int = Field(
        2, ge=1, le=64, description="Child processes per reward worker (isolate only); the samples of a group are scored across them in parallel."
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
        return self


class PackerConfig(Section):
    """Staleness filter and padding-free packing."""

    max_off_policy_steps: int = Field(2, ge=0, le=1000, description="Drop groups whose lag (step - oldest policy version) exceeds this.")
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 22, description="Token budget of one packed micro-batch.")
    filter_equal_rewards: bool = Field(
        False, description="Drop (outcome 'filtered') groups whose rewards are all equal: zero advantage, no policy gradient (DAPO dynamic sampling); a replacement is issued."
    )


class LossConfig(Section):
    """The policy loss and its options (trainer/losses/; field for field the same as its LossSpec).

    Ratios: pi_rollout sampled the token, pi_train is the trainer now, pi_old the trainer at the
    start of the step. "mismatch ratio" = pi_train / pi_rollout.
    """

    type: Literal["aipo", "ppo_clip", "importance_sampling", "gspo"] = Field(
        "aipo",
        description="aipo: masked importance-weighted policy gradient -sg(r*A)*log pi (prime-rl); ppo_clip: "
        "max(-A*r, -A*clip(r, 1-eps_clip, 1+eps_clip_high)); importance_sampling: -(r*A), no clip; gspo: "
        "sequence-level geometric-mean ratio with clipping (arXiv:2507.18071).",
    )
    adv_tau: float = Field(1.0, ge=0, allow_inf_nan=False, description="Weight of the advantage (every type).")
    ratio_type: Literal["token", "sequence"] = Field(
        "token", description="aipo only: weight each token by its own ratio, or by its sample's product of ratios clipped at sequence_clip_high."
    )
    token_mask_low: float = Field(0.125, ge=0, le=1, allow_inf_nan=False, description="aipo only: loss tokens with mismatch ratio below this get zero gradient.")
    token_mask_high: float = Field(8.0, ge=1, allow_inf_nan=False, description="aipo only: loss tokens with mismatch ratio above this get zero gradient.")
    geo_mask_low: float = Field(0.1, ge=0, le=1, allow_inf_nan=False, description="aipo only: samples whose geometric-mean mismatch ratio is below this get zero gradient.")
    geo_mask_high: float = Field(10.0, ge=1, allow_inf_nan=False, description="aipo only: samples whose geometric-mean mismatch ratio is above this get zero gradient.")
    sequence_mask_low: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False, description="aipo only, null = off: samples with any loss token's mismatch ratio below this get zero gradient."
    )
    sequence_mask_high: float | None = Field(
        None, ge=1, allow_inf_nan=False, description="aipo only, null = off: samples with any loss token's mismatch ratio above this get zero gradient."
    )
    sequence_clip_high: float = Field(10.0, ge=1, allow_inf_nan=False, description="aipo with ratio_type sequence: upper clip of the sample's ratio.")
    eps_clip: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False, description="ppo_clip and gspo: lower clip 1 - eps_clip of the ratio (GSPO paper: 3e-4).")
    eps_clip_high: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="ppo_clip and gspo: upper clip 1 + eps_clip_high (DAPO clip-higher: 0.28; GSPO paper: 4e-4); null = eps_clip."
    )
    eps_clip_c: float | None = Field(
        None, gt=1, allow_inf_nan=False, description="ppo_clip only, null = off: dual clip, a negative-advantage token's loss is at most -A * eps_clip_c (verl default 3)."
    )
    icepop_beta: float | None = Field(
        None, gt=1, allow_inf_nan=False, description="Any type, null = off: IcePop, loss tokens whose mismatch ratio is outside [1/beta, beta] get zero gradient."
    )
    use_tis: bool = Field(
        False,
        description="Any type: truncated importance sampling; the ratio becomes pi_train/pi_old and each token's loss is weighted "
        "by clip(pi_old/pi_rollout, tis_clip_low, tis_clip_high).",
    )
    tis_clip_low: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="Lower bound of the TIS weight.")
    tis_clip_high: float = Field(2.0, ge=1, allow_inf_nan=False, description="Upper bound of the TIS weight (the TIS blog's C = 2).")
    kl_tau: float = Field(0.0, ge=0, allow_inf_nan=False, description="Any type: weight of the per-token KL(pi_train || reference) penalty; 0 = off.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL penalty estimator (Schulman): k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2, k3 = ref/pi - 1 - log(ref/pi)."
    )
    kl_reference: Literal["rollout", "reference"] = Field(
        "rollout", description="KL penalty against the sampler's logprobs, or a frozen reference model's (samples must carry them)."
    )
    teacher_tau: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Any type: on-policy distillation, advantage += teacher_tau * (teacher_logprobs - train_logprobs); needs teacher logprobs."
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: over every loss token of the step; seq_mean_token_mean: mean over samples of each sample's "
        "token mean; seq_mean_token_sum_norm: sum over tokens / sampling.max_tokens, mean over samples (Dr. GRPO).",
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "LossConfig":
        if not self.tis_clip_low < self.tis_clip_high:
            raise ValueError(f"need tis_clip_low < tis_clip_high, got {self.tis_clip_low} and {self.tis_clip_high}")
        if self.type != "aipo":
            aipo_only = [k for k in ("sequence_mask_low", "sequence_mask_high") if getattr(self, k) is not None]
            aipo_only += ["ratio_type"] if self.ratio_type != "token" else []
            if aipo_only:
                raise ValueError(f"{', '.join(aipo_only)} only apply to type aipo (type is {self.type}): remove them or set type: aipo")
        if self.type != "ppo_clip" and self.eps_clip_c is not None:
            raise ValueError(f"eps_clip_c (dual clip) only applies to type ppo_clip (type is {self.type}): remove it")
        return self


class LoraSection(Section):
    """LoRA adapter (peft); disabled means full fine-tuning."""

    enabled: bool = Field(False, description="Train a LoRA adapter instead of all weights.")
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get adapters.",
    )


class OptimConfig(Section):
    """AdamW with a constant learning rate."""

    lr: float = Field(1e-4, gt=0, le=1.0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")


class TrainerConfig(Section):
    """The trainer."""

    max_steps: int = Field(60, ge=1, description="Optimizer steps of the run.")
    batch_size: int = Field(64, ge=1, description="Samples per optimizer step (a multiple of producers.group_size).")
    seed: int = Field(0, description="torch seed.")
    num_threads: int = Field(0, ge=0, le=1024, description="torch CPU threads of the trainer; 0 keeps torch's default. On a small CPU host leave cores to vLLM.")
    idle_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="torch CPU threads while the producers have nothing to sample (every step they may sample ahead, "
        "max_async_level, is already buffered): take the cores vLLM leaves idle on a shared CPU host (trainer/threads.py). "
        "0: always num_threads.",
    )
    checkpoint_interval: int = Field(
        10,
        ge=0,
        description="Save a resumable checkpoint (weights or adapter, optimizer, RNG, step, policy version) every this many optimizer "
        "steps and after the last one. The trainer releases a step's micro-batches and announces its groups as trained only once a "
        "checkpoint covers it, so the packer holds up to this many steps of micro-batches (one more while a checkpoint is written in the background). 0: no periodic checkpoints; steps are "
        "released right after training and a restarted trainer cannot resume (it refuses to start).",
    )
    checkpoint_keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept on disk; older ones are deleted after each save.")
    data_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description="Data-parallel trainer ranks on this host. > 1: busctl launches the trainer under torchrun "
        "(`torch.distributed.run --standalone --nproc-per-node N`) as one supervised component; rank 0 talks to the bus "
        "and sends every other rank its share of each step's micro-batches; gradients are summed over ranks (DDP).",
    )
    dp_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the data-parallel gradients; auto: nccl with CUDA (rank r on cuda:r), else gloo."
    )
    dp_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Bound on each collective of the data-parallel group, seconds; ranks > 0 wait up to this long for "
        "rank 0's next step (which waits for the bus), so keep it above the slowest step.",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraSection = Field(default_factory=LoraSection)


class NoiseSchedulerConfig(Section):
    """QeRL adaptive noise on the RMSNorm weights sent to the producers (broadcaster/noise.py)."""

    enabled: bool = Field(False, description="Add N(0, sigma^2) to the input/post-attention/final RMSNorm weights the producers receive; the trainer's stay clean.")
    sigma_start: float = Field(5e-2, gt=0, le=1.0, description="Sigma of the first noisy stage (QeRL Sec. 4.1 uses 5e-2 to 5e-4).")
    sigma_end: float = Field(5e-4, gt=0, le=1.0, description="Sigma of the last stage; geometric decay from sigma_start (QeRL eq. 8).")
    num_stages: int = Field(10, ge=2, le=10_000, description="Equal stages over trainer.max_steps; the first has no noise, the other num_stages - 1 decay from sigma_start to sigma_end.")
    seed: int = Field(0, ge=0, description="Noise seed; version v's noise is drawn from seed * 1000003 + v.")

    @model_validator(mode="after")
    def _decays(self) -> "NoiseSchedulerConfig":
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"noise_scheduler.sigma_end ({self.sigma_end}) > sigma_start ({self.sigma_start}); the noise decays: swap them")
        return self


class BroadcastConfig(Section):
    """How new weights reach the producers."""

    method: Literal["broadcast", "filesystem"] = Field("broadcast", description="torch.distributed broadcast, or a safetensors directory + READY marker.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto: nccl with CUDA, else gloo.")
    host: str = Field("127.0.0.1", description="Rendezvous host of the broadcast group (the trainer's address).")
    port: int = Field(0, ge=0, le=65535, description="Rendezvous port; 0 picks a free one at start-up.")
    timeout_s: float = Field(300.0, gt=0, description="Bound on the group rendezvous and on each broadcast, seconds.")
    lora_payload: Literal["adapter", "merged"] = Field(
        "adapter",
        description="With trainer.lora and method broadcast: send only the adapter (producers merge it into the base weights they keep), "
        "or the merged full weights. The filesystem method always writes merged weights.",
    )
    noise_scheduler: NoiseSchedulerConfig = Field(default_factory=NoiseSchedulerConfig)


class BusConfig(Section):
    """Transport of the bus."""

    transport: Literal["ipc", "tcp"] = Field("ipc", description="ipc:// sockets under the run directory, or tcp://.")
    host: str = Field("127.0.0.1", description="tcp host to bind and connect.")
    base_port: int = Field(5550, ge=1024, le=65000, description="First tcp port (topics use fixed offsets).")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long busctl waits for a component's ready handshake, seconds.")
    heartbeat_s: float = Field(0.5, gt=0, le=60, description="Every peer of a data topic, and every component towards busctl, sends a heartbeat this often, seconds.")
    dead_after_s: float = Field(
        10.0, gt=0, le=3600, description="A peer silent this long is declared dead: the messages it held are re-sent to live peers (and busctl restarts a silent component), seconds."
    )
    ack_timeout_s: float = Field(5.0, gt=0, le=3600, description="A data message not acknowledged as received within this is re-sent, seconds.")
    curve_keys_dir: str = Field(
        "",
        description="CurveZMQ key directory made by `busctl keys DIR` (relative to the working directory). Empty: no "
        "authentication. With transport tcp every socket runs CURVE and only client keys in DIR/clients/*.key get in; "
        "with ipc it is checked but not used (ipc:// is guarded by the socket directory's file permissions).",
    )
    curve_client: str = Field(
        "components",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Client keypair this host's processes use: DIR/clients/NAME.key_secret.",
    )

    @model_validator(mode="after")
    def _curve_keys_exist(self) -> "BusConfig":
        if self.curve_keys_dir:
            from bus.auth import CurveKeys  # zmq, only when CURVE is configured

            CurveKeys.load(self.curve_keys_dir, self.curve_client)  # ValueError names the missing path
        return self


class SupervisorConfig(Section):
    """How `busctl up` heals: restarts with exponential backoff and a restart budget."""

    restart: bool = Field(True, description="Restart a component that exits or goes silent before the run is done; False: such an exit fails the run.")
    max_restarts: int = Field(20, ge=0, le=10_000, description="Restart budget per component; one more crash fails the run.")
    backoff_initial_s: float = Field(0.5, ge=0, le=600, description="Delay before the first restart of a component, seconds; doubles per consecutive crash.")
    backoff_max_s: float = Field(30.0, ge=0, le=3600, description="Longest delay between restarts, seconds.")
    backoff_reset_s: float = Field(60.0, gt=0, description="A component that stayed up this long gets its backoff reset, seconds.")


class MetricsConfig(Section):
    """Prometheus endpoints."""

    base_port: int = Field(0, ge=0, le=65000, description="First metrics port (component k uses base_port + k); 0: any free port.")


class ReportConfig(Section):
    """Run reports: examples appended to ``RUN_DIR/samples.jsonl`` for ``busctl report``."""

    samples_interval: int = Field(
        10, ge=0, le=1_000_000,
        description="Every this many optimizer steps (steps s with s % N == 0, from step 0) the packer appends examples of the step to RUN_DIR/samples.jsonl; 0: never.",
    )
    samples_per_step: int = Field(
        4, ge=1, le=64, description="Examples (prompt, completion, reward, advantage) written per sampled step: the step's first samples, whole groups first."
    )


class RunConfig(Section):
    """One rlbus run."""

    name: str = Field("reverse_text", description="Run name.")
    run_dir: str = Field("runs/reverse_text", description="Directory for config, logs, sockets and metrics.jsonl.")
    max_async_level: int = Field(1, ge=0, le=1000, description="Prompts for step s are issued only while trainer_version >= s - max_async_level.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    producers: ProducersConfig = Field(default_factory=ProducersConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    packer: PackerConfig = Field(default_factory=PackerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        g = self.producers.group_size
        if self.trainer.batch_size % g:
            raise ValueError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of producers.group_size ({g})"
            )
        if self.bus.dead_after_s <= 2 * self.bus.heartbeat_s:
            raise ValueError(f"bus.dead_after_s ({self.bus.dead_after_s}) must exceed 2 x bus.heartbeat_s ({self.bus.heartbeat_s})")
        if self.trainer.loss.teacher_tau > 0 and not self.teacher.model_path:
            raise ValueError("trainer.loss.teacher_tau > 0 needs teacher logprobs: set teacher.model_path (or teacher_tau: 0)")
        if self.max_async_level > self.packer.max_off_policy_steps:
            raise ValueError(
                f"max_async_level ({self.max_async_level}) > packer.max_off_policy_steps "
                f"({self.packer.max_off_policy_steps}) would drop groups by design; raise max_off_policy_steps"
            )
        return self

    @property
    def prompts_per_step(self) -> int:
        """Groups (prompts) consumed by one optimizer step."""
        return self.trainer.batch_size // self.producers.group_size


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override (value parsed as YAML) to a raw config dict.

    Raises:
        ConfigError: the override has no ``=`` or walks into a non-mapping.
    """
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    key, _, value = override.partition("=")
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = _parse_value(value)


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check the spelling (see `busctl up --dry-run`)")
        elif isinstance(e.get("input"), dict):
            lines.append(f"  {key}: {e['msg']}")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config (default: ``configs/reverse_text.yaml``) and apply dotted overrides.

    Raises:
        ConfigError: the file is missing or not a YAML mapping, or a key/value is invalid
            (the message names every bad key and the fix).
    """
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a YAML mapping at the top level")
    for override in overrides:
        apply_override(data, override)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: {_describe(err)}") from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what ``busctl up --dry-run`` prints and runs save)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
