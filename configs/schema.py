"""The typed run configuration of rlbus (pydantic), loaded from YAML with dotted overrides.

A run is one :class:`RunConfig`; each component reads its own section. Every field has a
description and bounds; unknown keys are errors (``extra="forbid"``), and the error message names
the dotted key and what to change. This module imports no torch, so the supervisor and tests can
load configs cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = CONFIG_DIR / "reverse_text.yaml"


class Section(BaseModel):
    """Base of every config section: forbids unknown keys, validates assignments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """The policy model."""

    path: str = Field("", description="Local HF model directory. Empty: build (or reuse from the cache) rlbus's tiny reverse-text policy.")
    cache_dir: str = Field(".cache/rlbus", description="Where the tiny policy is built and cached (relative to the working directory).")
    sft_steps: int = Field(300, ge=0, le=100_000, description="Most supervised warm-start steps of the tiny policy.")
    sft_target_loss: float = Field(1.7, ge=0, description="The warm start stops once its training loss (nats/token) falls below this: deliberately partial, so that RL has room.")
    max_model_len: int = Field(256, ge=16, le=131_072, description="Longest prompt + completion, tokens.")


class TaskConfig(Section):
    """The task: dataset and reward function."""

    name: str = Field("reverse_text", description="Task name; selects dataset and reward function.")
    num_train_examples: int = Field(20_000, ge=1, description="Training prompts available (cycled if exhausted).")
    num_eval_examples: int = Field(128, ge=1, description="Held-out prompts for eval_reward_mean.")
    seed: int = Field(0, description="Seed of the training prompts.")
    eval_seed: int = Field(1234, description="Seed of the held-out eval prompts (fixed, so runs compare on the same set).")


class SamplingConfig(Section):
    """vLLM sampling parameters of the rollout producers."""

    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature; the trainer scores with the same one.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(32, ge=1, le=65_536, description="Most completion tokens per sample.")


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
    reward_fn: str = Field(
        "",
        description="Reward function: a registered name, or an import path 'package.module:function' (runs the code it "
        "names: configs are trusted); empty: the task's own.",
    )
    std_normalize: bool = Field(True, description="Divide advantages by the group std (GRPO); False: mean-centred only (Dr. GRPO).")
    eps: float = Field(1e-6, gt=0, description="Added to the std in the advantage denominator.")
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


class PackerConfig(Section):
    """Staleness filter and padding-free packing."""

    max_off_policy_steps: int = Field(2, ge=0, le=1000, description="Drop groups whose lag (step - oldest policy version) exceeds this.")
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 22, description="Token budget of one packed micro-batch.")
    filter_equal_rewards: bool = Field(
        False, description="Drop (outcome 'filtered') groups whose rewards are all equal: zero advantage, no policy gradient (DAPO dynamic sampling); a replacement is issued."
    )


class LossConfig(Section):
    """Token-level AIPO-style GRPO loss (see trainer/loss.py)."""

    adv_tau: float = Field(1.0, ge=0, description="Weight of the advantage term.")
    kl_tau: float = Field(0.0, ge=0, description="Weight of the -log_ratio (KL-like) term.")
    token_mask_low: float = Field(0.125, gt=0, description="Tokens with importance ratio below this are masked.")
    token_mask_high: float = Field(8.0, gt=0, description="Tokens with importance ratio above this are masked.")
    geo_mask_low: float = Field(0.1, gt=0, description="Samples whose geometric-mean ratio is below this are masked.")
    geo_mask_high: float = Field(10.0, gt=0, description="Samples whose geometric-mean ratio is above this are masked.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "LossConfig":
        if not self.token_mask_low < 1.0 < self.token_mask_high:
            raise ValueError("need token_mask_low < 1 < token_mask_high")
        if not self.geo_mask_low < 1.0 < self.geo_mask_high:
            raise ValueError("need geo_mask_low < 1 < geo_mask_high")
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
    eval_num_samples: int = Field(1, ge=1, description="Samples per eval prompt.")
    checkpoint_interval: int = Field(
        10,
        ge=0,
        description="Save a resumable checkpoint (weights or adapter, optimizer, RNG, step, policy version) every this many optimizer "
        "steps and after the last one. The trainer releases a step's micro-batches and announces its groups as trained only once a "
        "checkpoint covers it, so the packer holds up to this many steps of micro-batches. 0: no periodic checkpoints; steps are "
        "released right after training and a restarted trainer cannot resume (it refuses to start).",
    )
    checkpoint_keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept on disk; older ones are deleted after each save.")
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraSection = Field(default_factory=LoraSection)


class BroadcastConfig(Section):
    """How new weights reach the producers."""

    method: Literal["broadcast", "filesystem"] = Field("broadcast", description="torch.distributed broadcast, or a safetensors directory + READY marker.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto: nccl with CUDA, else gloo.")
    host: str = Field("127.0.0.1", description="Rendezvous host of the broadcast group (the trainer's address).")
    port: int = Field(0, ge=0, le=65535, description="Rendezvous port; 0 picks a free one at start-up.")
    timeout_s: float = Field(300.0, gt=0, description="Bound on the group rendezvous and on each broadcast, seconds.")


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


class RunConfig(Section):
    """One rlbus run."""

    name: str = Field("reverse_text", description="Run name.")
    run_dir: str = Field("runs/reverse_text", description="Directory for config, logs, sockets and metrics.jsonl.")
    max_async_level: int = Field(1, ge=0, le=1000, description="Prompts for step s are issued only while trainer_version >= s - max_async_level.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    producers: ProducersConfig = Field(default_factory=ProducersConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    packer: PackerConfig = Field(default_factory=PackerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        g = self.producers.group_size
        if self.trainer.batch_size % g:
            raise ValueError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of producers.group_size ({g})"
            )
        if self.bus.dead_after_s <= 2 * self.bus.heartbeat_s:
            raise ValueError(f"bus.dead_after_s ({self.bus.dead_after_s}) must exceed 2 x bus.heartbeat_s ({self.bus.heartbeat_s})")
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
