"""The typed run configuration of rlbus (pydantic), loaded from YAML with dotted overrides.

A run is one :class:`RunConfig`; each component reads its own section. Every field has a
description and bounds; unknown keys are errors (``extra="forbid"``), and the error message names
the dotted key and what to change. The rollout-side sections (task, sampling, teacher, filters,
eval) live in :mod:`configs.rollout`, the shared base class in :mod:`configs.base`. This module
imports no torch and nothing of the bus (no zmq), so the supervisor and tests can load configs cheaply:
the keys of ``bus.hosts`` are checked against :mod:`configs.topic_names`, and the CurveZMQ key files
that ``bus.curve_keys_dir`` names are read at launch (:func:`bus.auth.check_keys`), not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from configs.base import Section
from configs.cluster import SlurmConfig
from configs.serve import ServeConfig
from configs.code_paths import resolve_code_paths
from configs.errors import ConfigError, describe_validation, parse_override, read_yaml_file
from configs.rewards import RewardsConfig
from configs.rollout import EvalConfig, FiltersConfig, SamplingConfig, TaskConfig, TeacherConfig
from configs.bus_limits import DEFAULT_MAX_INFLIGHT_BYTES, check_inflight_bytes
from configs.servers import EngineFields, check_server_engine
from configs.topic_names import endpoint_key_ok
from configs.training import LoraSection, LossConfig, OptimConfig, TrainerConfig

__all__ = [
    "ConfigError",
    "LoraSection",
    "LossConfig",
    "OptimConfig",
    "RewardsConfig",
    "RunConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
]

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = CONFIG_DIR / "reverse_text.yaml"


class ModelConfig(Section):
    """The policy model."""

    path: str = Field(
        "",
        description=(
            "HF model directory, or a hub id (org/name[@revision]) from the local HF cache, offline (docs/models.md). "
            "Empty: build (or reuse from the cache) rlbus's tiny reverse-text policy."
        ),
    )
    cache_dir: str = Field(
        ".cache/rlbus", description="Where the tiny policy is built and cached (relative to the working directory)."
    )
    sft_steps: int = Field(300, ge=0, le=100_000, description="Most supervised warm-start steps of the tiny policy.")
    sft_target_loss: float = Field(
        1.7,
        ge=0,
        description=(
            "The warm start stops once its training loss (nats/token) falls below this: deliberately partial, so that "
            "RL has room."
        ),
    )
    max_model_len: int = Field(256, ge=16, le=131_072, description="Longest prompt + completion, tokens.")


class ProducersConfig(EngineFields):
    """Rollout producers (one vLLM AsyncLLM engine each, or inference servers: `configs.servers`)."""

    replicas: int = Field(1, ge=1, le=64, description="Number of producer processes.")
    group_size: int = Field(8, ge=1, le=1024, description="Completions per prompt (G).")
    max_concurrent_groups: int = Field(8, ge=1, le=4096, description="Groups a producer generates at once.")
    weight_update: Literal["keep", "drain"] = Field(
        "keep",
        description="How a producer's engine takes new weights while it generates. keep: in-flight requests pause, are "
        "recomputed under the new weights and continue (partial rollouts: later tokens are newer). drain: the update "
        "waits "
        "until the requests in flight finish under the old weights (new ones queue), so no prefill is recomputed; "
        "every "
        "sample then has one policy version. Both keep the max_async_level bound; drain suits short completions, keep "
        "long ones.",
    )
    prefetch_steps: int = Field(
        1,
        ge=0,
        le=64,
        description="Steps of training prompts the prompt source issues beyond the async gate (max_async_level). A "
        "producer holds "
        "such a prompt, outside max_concurrent_groups, until its engine runs a policy version >= the prompt's step - "
        "max_async_level, and starts it the moment the weights are applied (no round trip through the prompt source on "
        "the critical path). The async bound is unchanged. 0: the prompt source alone gates.",
    )
    kv_cache_gib: float = Field(1.0, gt=0, le=1024, description="vLLM KV-cache size per engine, GiB.")
    seed: int = Field(0, description="vLLM sampling seed (producer i uses seed + i).")
    max_replicas: int = Field(
        8,
        ge=1,
        le=64,
        description=(
            "Most producers the run can have (`busctl scale producers=N` up to this): reward workers connect to this "
            "many rollouts endpoints."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="vLLM weights and compute dtype; the trainer sends weights in this dtype (bfloat16: half the "
        "bytes). "
        "auto: bfloat16 on a GPU, float32 on CPU.",
    )
    gpus_per_replica: int = Field(
        1,
        ge=0,
        le=64,
        description="CUDA devices busctl gives each producer replica (CUDA_VISIBLE_DEVICES) when the run uses GPUs; "
        "equals "
        "tensor_parallel_size. 0: producers run vLLM on CPU even on a GPU host.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="vLLM tensor-parallel size of each producer (its GPUs, gpus_per_replica)."
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of each of its GPUs' memory a producer's vLLM engine may take (weights, activations, KV "
        "cache). "
        "Lower it when a producer shares a GPU with the trainer (share_gpus_with_trainer).",
    )
    endpoint_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="OpenAI-compatible endpoint of each producer (/v1/chat/completions, /v1/completions): producer i "
        "serves on "
        "port endpoint_port + i; 0: any free port (the URL is in the producer's log; the port in "
        "rlbus_producer_endpoint_port and status.json). "
        "null: no endpoint, unless task.agent is set (then any free port).",
    )
    endpoint_host: str = Field(
        "127.0.0.1",
        description="Address the producers' endpoints bind (0.0.0.0: reachable from other hosts). Beyond loopback "
        "every request needs an API key (X-API-Key or Authorization: Bearer): RLBUS_SERVE_API_KEYS, "
        "endpoint_api_keys_file, or the key each producer makes for its own agents; busctl up refuses such a run "
        "with no key for outside clients.",
    )
    endpoint_api_keys_file: str = Field(
        "",
        description="A file of API keys (one per line) the producers' endpoints accept when endpoint_host is not "
        "loopback; RLBUS_SERVE_API_KEYS (comma-separated) adds keys.",
    )
    share_gpus_with_trainer: bool = Field(
        False,
        description="Allow producers on the trainer's GPUs (a one-GPU host): busctl otherwise refuses a plan where a "
        "producer "
        "and the trainer would use the same device.",
    )

    @model_validator(mode="after")
    def _room_for_replicas(self) -> "ProducersConfig":
        if self.replicas > self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) > max_replicas ({self.max_replicas}); raise max_replicas")
        if self.gpus_per_replica and self.gpus_per_replica != self.tensor_parallel_size:
            raise ValueError(
                f"gpus_per_replica ({self.gpus_per_replica}) must equal tensor_parallel_size "
                f"({self.tensor_parallel_size}) "
                "(or be 0: vLLM on CPU)"
            )
        return self


class PackerConfig(Section):
    """Staleness filter and padding-free packing."""

    max_off_policy_steps: int = Field(
        2, ge=0, le=1000, description="Drop groups whose lag (step - oldest policy version) exceeds this."
    )
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 22, description="Token budget of one packed micro-batch.")
    filter_equal_rewards: bool = Field(
        False,
        description=(
            "Drop (outcome 'filtered') groups whose rewards are all equal: zero advantage, no policy gradient (DAPO "
            "dynamic sampling); a replacement is issued."
        ),
    )


class NoiseSchedulerConfig(Section):
    """QeRL adaptive noise on the RMSNorm weights sent to the producers (broadcaster/noise.py)."""

    enabled: bool = Field(
        False,
        description=(
            "Add N(0, sigma^2) to the input/post-attention/final RMSNorm weights the producers receive; the trainer's "
            "stay clean."
        ),
    )
    sigma_start: float = Field(
        5e-2, gt=0, le=1.0, description="Sigma of the first noisy stage (QeRL Sec. 4.1 uses 5e-2 to 5e-4)."
    )
    sigma_end: float = Field(
        5e-4, gt=0, le=1.0, description="Sigma of the last stage; geometric decay from sigma_start (QeRL eq. 8)."
    )
    num_stages: int = Field(
        10,
        ge=2,
        le=10_000,
        description=(
            "Equal stages over trainer.max_steps; the first has no noise, the other num_stages - 1 decay from "
            "sigma_start to sigma_end."
        ),
    )
    seed: int = Field(0, ge=0, description="Noise seed; version v's noise is drawn from seed * 1000003 + v.")

    @model_validator(mode="after")
    def _decays(self) -> "NoiseSchedulerConfig":
        if self.sigma_end > self.sigma_start:
            raise ValueError(
                f"noise_scheduler.sigma_end ({self.sigma_end}) > sigma_start ({self.sigma_start}); the noise decays: "
                f"swap them"
            )
        return self


class BroadcastConfig(Section):
    """How new weights reach the producers."""

    method: Literal["broadcast", "filesystem", "bus"] = Field(
        "broadcast",
        description="torch.distributed broadcast, a safetensors directory + READY marker, or bus: bucketed weights "
        "pulled by each producer as zero-copy frames from the trainer's `weights` endpoint (no shared filesystem, no "
        "torch.distributed group; tcp:// + CurveZMQ across hosts). Left unset with bus.transport: tcp it is bus (the "
        "authenticated path); broadcast over tcp must be chosen, and its rendezvous (TCPStore) and gloo/NCCL accept "
        "any "
        "peer that reaches broadcast.host:port (docs/operations.md).",
    )
    fallback: Literal["filesystem", "bus"] = Field(
        "filesystem",
        description="With method broadcast: how weights reach producers outside the group (late joiners, re-form "
        "misses, a restarted trainer, a broadcast that failed for good): a safetensors directory (needs a filesystem "
        "the "
        "producers share with the trainer), or the bus method.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto: nccl with CUDA, else gloo."
    )
    host: str = Field("127.0.0.1", description="Rendezvous host of the broadcast group (the trainer's address).")
    port: int = Field(0, ge=0, le=65535, description="Rendezvous port; 0 picks a free one at start-up.")
    timeout_s: float = Field(300.0, gt=0, description="Bound on the group rendezvous and on each broadcast, seconds.")
    reform_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Bound on re-forming the broadcast group when a producer joins or a member died (and on each "
        "broadcast in a re-formed group), seconds; members that miss it take weights by the filesystem method.",
    )
    lora_payload: Literal["adapter", "merged"] = Field(
        "adapter",
        description="With trainer.lora and method broadcast or bus: send only the adapter (producers merge it into the "
        "base weights they "
        "keep), or the merged full weights. The filesystem method always writes merged weights.",
    )
    noise_scheduler: NoiseSchedulerConfig = Field(default_factory=NoiseSchedulerConfig)


class BusConfig(Section):
    """Transport of the bus."""

    transport: Literal["ipc", "tcp"] = Field("ipc", description="ipc:// sockets under the run directory, or tcp://.")
    host: str = Field("127.0.0.1", description="tcp host to bind and connect.")
    base_port: int = Field(5550, ge=1024, le=65000, description="First tcp port (topics use fixed offsets).")
    ready_timeout_s: float = Field(
        300.0, gt=0, description="How long busctl waits for a component's ready handshake, seconds."
    )
    heartbeat_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description=(
            "Every peer of a data topic, and every component towards busctl, sends a heartbeat this often, seconds."
        ),
    )
    dead_after_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description=(
            "A peer silent this long is declared dead: the messages it held are re-sent to live peers (and busctl "
            "restarts a silent component), seconds."
        ),
    )
    ack_timeout_s: float = Field(
        5.0, gt=0, le=3600, description="A data message not acknowledged as received within this is re-sent, seconds."
    )
    max_inflight_bytes: int | dict[str, int] = Field(
        DEFAULT_MAX_INFLIGHT_BYTES,
        description="Byte bound of every data topic's credit window, bytes: a receiver grants each sender at most this "
        "many "
        "bytes waiting in its inbox, and an outbox holds at most this many bytes not yet taken before send blocks (as "
        "well "
        "as the topic's message bound); a larger message still passes alone. One number for every data topic, or a map "
        "{topic: bytes} over prompts, rollouts, scored, batches, outcomes (others keep the default, 32 MiB).",
    )
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
    hosts: dict[str, str] = Field(
        default_factory=dict,
        description="tcp host (address) of the side that binds each endpoint, when components run on several hosts: "
        "keys are "
        "topic names (prompts, scored, batches, outcomes, control_pub, control_sub, supervisor) or rollouts-I "
        "(producer I); "
        "a key not given uses bus.host. `busctl up --launcher slurm` writes it into the run's config.yaml.",
    )

    @model_validator(mode="after")
    def _hosts_known(self) -> "BusConfig":
        check_inflight_bytes(self.max_inflight_bytes)
        # The key files of curve_keys_dir are read at launch (bus.auth.check_keys), not here: configs import no bus.
        bad = [k for k in self.hosts if not endpoint_key_ok(k)]
        if bad:
            raise ValueError(f"bus.hosts: unknown endpoint(s) {bad}; keys are topic names or rollouts-I")
        return self


class SupervisorConfig(Section):
    """How `busctl up` heals: restarts with exponential backoff and a restart budget."""

    restart: bool = Field(
        True,
        description=(
            "Restart a component that exits or goes silent before the run is done; False: such an exit fails the run."
        ),
    )
    max_restarts: int = Field(
        20, ge=0, le=10_000, description="Restart budget per component; one more crash fails the run."
    )
    backoff_initial_s: float = Field(
        0.5,
        ge=0,
        le=600,
        description="Delay before the first restart of a component, seconds; doubles per consecutive crash.",
    )
    backoff_max_s: float = Field(30.0, ge=0, le=3600, description="Longest delay between restarts, seconds.")
    backoff_reset_s: float = Field(
        60.0, gt=0, description="A component that stayed up this long gets its backoff reset, seconds."
    )
    launcher: Literal["local", "slurm", "ray"] = Field(
        "local",
        description="How components are started: local processes, one srun step each inside a Slurm allocation, or one "
        "Ray actor each on a node of a running Ray cluster (busctl up --launcher).",
    )
    ray_address: str = Field(
        "auto",
        min_length=1,
        description=(
            "The Ray cluster of launcher ray (ray.init(address=...)); auto: the one this host belongs to (busctl up "
            "--address)."
        ),
    )


class MetricsConfig(Section):
    """Prometheus endpoints."""

    base_port: int = Field(
        0, ge=0, le=65000, description="First metrics port (component k uses base_port + k); 0: any free port."
    )


class ReportConfig(Section):
    """Run reports: examples appended to ``RUN_DIR/samples.jsonl`` for ``busctl report``."""

    samples_interval: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description=(
            "Every this many optimizer steps (steps s with s % N == 0, from step 0) the packer appends examples of the "
            "step to RUN_DIR/samples.jsonl; 0: never."
        ),
    )
    samples_per_step: int = Field(
        4,
        ge=1,
        le=64,
        description=(
            "Examples (prompt, completion, reward, advantage) written per sampled step: the step's first samples, "
            "whole groups first."
        ),
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers fed from the run's metrics.jsonl, stages.jsonl and samples.jsonl by a process "
        "of their own "
        "(trackers/; never on the trainer's path): tensorboard (RUN_DIR/tensorboard/), wandb (offline under "
        "RUN_DIR/wandb/ when "
        "no API key is set or WANDB_MODE=offline), mlflow (MLFLOW_TRACKING_URI, else a file store at RUN_DIR/mlruns/). "
        "Needs the trackers extra (pip install -e '.[trackers]'); a tracker that fails warns once and is dropped.",
    )

    @model_validator(mode="after")
    def _unique_trackers(self) -> "ReportConfig":
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"report.trackers {self.trackers} names a tracker twice; list each once")
        return self


def apply_weight_method_default(cfg: "RunConfig") -> None:
    """Set ``broadcast.method`` to ``bus`` when ``bus.transport`` is tcp and the method was not
    given (not in the section's ``model_fields_set``): across hosts weights then travel over the
    CurveZMQ-authenticated ``weights`` endpoint, not an unauthenticated torch.distributed group.
    An explicit ``broadcast.method`` (YAML or override) is kept. The config validator calls it,
    and a launcher that switches a loaded config to tcp (``busctl.launchers.multihost``) again."""
    if cfg.bus.transport == "tcp" and "method" not in cfg.broadcast.model_fields_set:
        cfg.broadcast.method = "bus"


class RunConfig(Section):
    """One rlbus run."""

    name: str = Field("reverse_text", description="Run name.")
    run_dir: str = Field("runs/reverse_text", description="Directory for config, logs, sockets and metrics.jsonl.")
    max_async_level: int = Field(
        1, ge=0, le=1000, description="Prompts for step s are issued only while trainer_version >= s - max_async_level."
    )
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
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        apply_weight_method_default(self)
        check_server_engine(self)
        g = self.producers.group_size
        if self.trainer.batch_size % g:
            raise ValueError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of producers.group_size ({g})"
            )
        if self.bus.dead_after_s <= 2 * self.bus.heartbeat_s:
            raise ValueError(
                f"bus.dead_after_s ({self.bus.dead_after_s}) must exceed 2 x bus.heartbeat_s ({self.bus.heartbeat_s})"
            )
        if (
            self.trainer.parallel == "fsdp"
            and self.trainer.data_parallel > 1
            and self.broadcast.noise_scheduler.enabled
        ):
            raise ValueError(
                "broadcast.noise_scheduler does not work with trainer.parallel: fsdp (weights are gathered one tensor "
                "at a time); use ddp"
            )
        if self.trainer.loss.teacher_tau > 0 and not self.teacher.model_path:
            raise ValueError(
                "trainer.loss.teacher_tau > 0 needs teacher logprobs: set teacher.model_path (or teacher_tau: 0)"
            )
        overlong = self.rewards.overlong
        if overlong is not None and overlong.buffer_tokens > (overlong.max_tokens or self.sampling.max_tokens):
            raise ValueError(
                f"rewards.overlong.buffer_tokens ({overlong.buffer_tokens}) exceeds its max_tokens "
                f"({overlong.max_tokens or self.sampling.max_tokens}); use a buffer of at most max_tokens tokens"
            )
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


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override (value parsed as YAML) to a raw config dict.

    Raises:
        ConfigError: the override has no ``=``, its value is not valid YAML, or it walks into a
            non-mapping (:func:`configs.errors.parse_override`).
    """
    parts, value = parse_override(override)
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {override!r}: {part!r} is not a section (it holds {child!r}); "
                f"set {'.'.join(parts[: depth + 1])}=VALUE instead"
            )
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config (default: ``configs/reverse_text.yaml``) and apply dotted overrides.

    Raises:
        ConfigError: the file is missing, unreadable, not valid YAML (with the line and column) or
            not a YAML mapping, an override is malformed, or a key/value is invalid (the message
            names every bad key, whether the file (and line) or an override set it, the nearest
            known key for an unknown one, and the fix; :mod:`configs.errors`).
    """
    path = Path(path) if path else DEFAULT_CONFIG
    data, text = read_yaml_file(path)
    for override in overrides:
        apply_override(data, override)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        applied = [(parse_override(o)[0], o) for o in overrides]
        raise ConfigError(describe_validation(err, RunConfig, path, text, applied)) from None
    overridden = any(parse_override(o)[0][:2] in (["task"], ["task", "code_paths"]) for o in overrides)
    cfg.task.code_paths = resolve_code_paths(cfg.task.code_paths, Path.cwd() if overridden else path.parent)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what ``busctl up --dry-run`` prints and runs save)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
