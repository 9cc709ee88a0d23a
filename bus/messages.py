"""Every message type of the bus: frozen dataclasses with a ``TYPE``; scalar fields travel in the msgpack
header, :func:`bus.wire.array_field` fields as raw frames. ``rollouts`` and ``scored`` carry one group per
message, so any reward worker computes a group's advantages alone. Each class gives sender, receiver and
every field's shape and dtype; ``check()`` is its cross-field validation (``WireError("inconsistent")``).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import numpy as np

from bus.sample_arrays import check_group, check_micro_batch
from bus.wire import ArraySpec, ChatMessages, WireError, array_field, check_terms, optional_field


def new_id() -> str:
    """A fresh message id (uuid4 hex, 32 chars)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, eq=False)
class Message:
    """Base of all message types; ``id`` is unique (a group id on data topics; consumers dedupe by it)."""

    TYPE: ClassVar[str] = ""
    id: str

    def check(self) -> None:
        """Cross-field checks of a decoded message; raises ``WireError('inconsistent')``."""

    @classmethod
    def array_specs(cls) -> dict[str, ArraySpec]:
        return {f.name: f.metadata["array"] for f in dataclasses.fields(cls) if "array" in f.metadata}


# ------------------------------------------------------------------------------------------------
# Data topics
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Prompt(Message):
    """One prompt, prompt source -> producer (topic ``prompts``).

    Fields:
        index: position in the issue order. step: the optimizer step it was issued for. task, info: the
            task and its data for the verifier (JSON-like). messages: ``[{"role": str, "content": str}, ...]``.
        eval_round: ``-1`` (training), else the policy version evaluated; eval_size: groups in the round.
    """

    TYPE: ClassVar[str] = "prompt"
    index: int
    step: int
    task: str
    messages: list
    info: dict
    temperature: float = optional_field(1.0)
    eval_round: int = optional_field(-1)
    eval_size: int = optional_field(0)

    @property
    def is_eval(self) -> bool:
        return self.eval_round >= 0

    def check(self) -> None:
        if not self.temperature > 0:
            raise WireError("inconsistent", "temperature must be > 0")
        if (self.eval_round >= 0) != (self.eval_size > 0):
            raise WireError(
                "inconsistent", "an eval prompt needs eval_round >= 0 and eval_size > 0, a training prompt neither"
            )


@dataclass(frozen=True, eq=False)
class RolloutGroup(Message):
    """The G completions of one prompt (``id``: the prompt id), producer -> reward worker (``rollouts``).
    Sample ``j`` owns ``completion_ids[offsets[j]:offsets[j+1]]``, ``offsets = [0, *cumsum(completion_lens)]``.

    Fields:
        prompt_index, step, task, info, temperature, eval_round, eval_size: the :class:`Prompt`'s.
        producer: its name. gen_time_s: generation wall time, seconds.
        completion_texts, finish_reasons: ``[G]`` decoded completions, vLLM finish reasons.
        prompt_ids: ``[P] int32`` (chat template applied). prompt_text: that prompt rendered, or ``""``.
        completion_ids: ``[N] int32`` every completion's tokens, concatenated. completion_lens: ``[G] int32``.
        sampler_logprobs: ``[N] float32`` each sampled token's logprob under the sampler (nats).
        version_start, version_end: ``[G] int64`` oldest / newest policy version of a sample's tokens.
        version_spans: ``[M, 2] int64`` ``(version, num_tokens)`` runs; version_span_counts: ``[G] int32``
            runs per sample; both empty when unknown (:mod:`bus.sample_arrays`).
        teacher_logprobs: ``[N] float32`` under the teacher (nats, temperature 1), or ``[0]``.
        loss_mask: ``[N] bool`` False on environment tokens of a multi-turn episode, or ``[0]``.
        env_rewards: ``[G] float32`` each episode's environment reward (term ``env``), or ``[0]``.
        prompt_messages: the prompt's initial chat messages (string ``role`` and ``content`` only, else
            rejected as ``field``) for TRL conversational rewards; ``[]`` when absent.
    """

    TYPE: ClassVar[str] = "rollout"
    prompt_index: int
    step: int
    task: str
    info: dict
    producer: str
    completion_texts: list[str]
    finish_reasons: list[str]
    gen_time_s: float
    prompt_ids: np.ndarray = array_field("int32")
    completion_ids: np.ndarray = array_field("int32")
    completion_lens: np.ndarray = array_field("int32")
    sampler_logprobs: np.ndarray = array_field("float32")
    version_start: np.ndarray = array_field("int64")
    version_end: np.ndarray = array_field("int64")
    temperature: float = optional_field(1.0)
    eval_round: int = optional_field(-1)
    eval_size: int = optional_field(0)
    teacher_logprobs: np.ndarray = array_field("float32", optional=True)
    prompt_text: str = optional_field("")
    version_spans: np.ndarray = array_field("int64", 2, optional=True)
    version_span_counts: np.ndarray = array_field("int32", optional=True)
    loss_mask: np.ndarray = array_field("bool", optional=True)
    env_rewards: np.ndarray = array_field("float32", optional=True)
    prompt_messages: ChatMessages = optional_field([], may_be_absent=True)

    @property
    def group_size(self) -> int:
        return len(self.completion_lens)

    @property
    def is_eval(self) -> bool:
        return self.eval_round >= 0

    def check(self) -> None:
        check_group(self)

    def completion(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids ``[L_j] int32`` and logprobs ``[L_j] float32`` of sample ``j``."""
        offsets = np.concatenate([[0], np.cumsum(self.completion_lens)])
        return (
            self.completion_ids[offsets[j] : offsets[j + 1]],
            self.sampler_logprobs[offsets[j] : offsets[j + 1]],
        )


@dataclass(frozen=True, eq=False)
class ScoredGroup(RolloutGroup):
    """A :class:`RolloutGroup` scored, reward worker -> packer (topic ``scored``).

    Fields:
        reward_worker: its name. rewards: ``[G] float32`` (weighted sum of the reward functions).
        advantages: ``[G] float32`` group-relative. reward_terms: ``{function: [G] floats}`` unweighted.
        flags: ``[G]`` comma-separated filters that flagged each sample, or ``[]`` when none ran.
        masked: ``[G] bool`` samples the loss must not use (an enforced filter), or ``[0]``.
    """

    TYPE: ClassVar[str] = "scored"
    reward_worker: str
    rewards: np.ndarray = array_field("float32")
    advantages: np.ndarray = array_field("float32")
    reward_terms: dict = optional_field({})
    flags: list[str] = optional_field([])
    masked: np.ndarray = array_field("bool", optional=True)

    def check(self) -> None:
        super().check()
        g = self.group_size
        if len(self.rewards) != g or len(self.advantages) != g:
            raise WireError("inconsistent", "rewards and advantages need one entry per completion")
        if not (np.isfinite(self.rewards).all() and np.isfinite(self.advantages).all()):
            raise WireError("inconsistent", "rewards and advantages must be finite")
        check_terms(self.reward_terms, g)
        if len(self.flags) not in (0, g) or len(self.masked) not in (0, g):
            raise WireError("inconsistent", f"flags and masked must be empty or have one entry per completion ({g})")


@dataclass(frozen=True, eq=False)
class MicroBatch(Message):
    """One packed, padding-free micro-batch, packer -> trainer (topic ``batches``); ``id``
    ``"{step}:{micro_index}"``. ``S`` samples (prompt + completion, positions from 0) in one row of ``T`` tokens.

    Fields:
        step: 0-based optimizer step. micro_index, num_micro_batches: place in the step.
        step_loss_tokens: loss tokens of the step. step_samples: samples of the step with a loss token.
        sample_ids: ``[S]`` ``"{group_id}/{j}"``. seq_lens: ``[S] int32`` (sum T). input_ids: ``[T] int32``.
        loss_mask: ``[T] bool``. sampler_logprobs, advantages: ``[T] float32`` (0 off completions).
        rewards: ``[S] float32``. oldest_versions: ``[S] int64``.
        token_versions: ``[T] int64`` the policy version of each token (prompt: the sample's oldest).
        teacher_logprobs: ``[T] float32``, or ``[0]``. temperature: every sample's (one per micro-batch).
        reward_terms: ``{function: [S] floats}``.
    """

    TYPE: ClassVar[str] = "micro_batch"
    step: int
    micro_index: int
    num_micro_batches: int
    step_loss_tokens: int
    step_samples: int
    sample_ids: list[str]
    input_ids: np.ndarray = array_field("int32")
    seq_lens: np.ndarray = array_field("int32")
    loss_mask: np.ndarray = array_field("bool")
    sampler_logprobs: np.ndarray = array_field("float32")
    advantages: np.ndarray = array_field("float32")
    rewards: np.ndarray = array_field("float32")
    oldest_versions: np.ndarray = array_field("int64")
    teacher_logprobs: np.ndarray = array_field("float32")
    token_versions: np.ndarray = array_field("int64")
    temperature: float = optional_field(1.0)
    reward_terms: dict = optional_field({})

    def check(self) -> None:
        check_micro_batch(self)


# ------------------------------------------------------------------------------------------------
# Control channel (PUB/SUB through the hub) and supervisor handshake
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class WeightsReady(Message):
    """New weights of policy ``version`` (= steps taken), trainer -> producers: ``method`` ``broadcast``,
    ``filesystem`` (directory ``path``, else ``""``) or ``bus``; ``manifest`` ``[[name, dtype, shape], ...]``
    in send order, full weights or a LoRA adapter (:mod:`broadcaster.manifest`); ``num_bytes`` the payload."""

    TYPE: ClassVar[str] = "weights.ready"
    version: int
    method: str
    manifest: list
    path: str
    num_bytes: int


@dataclass(frozen=True, eq=False)
class WeightsApplied(Message):
    """A producer has loaded ``version`` and tags later tokens with it; ``apply_time_s`` in seconds."""

    TYPE: ClassVar[str] = "weights.applied"
    producer: str
    version: int
    apply_time_s: float


@dataclass(frozen=True, eq=False)
class WeightsWanted(Message):
    """A late producer outside the weight group waits for ``version`` by the filesystem method."""

    TYPE: ClassVar[str] = "weights.wanted"
    producer: str
    version: int


@dataclass(frozen=True, eq=False)
class TrainerStep(Message):
    """The trainer finished ``step``, now at policy ``version``; ``metrics``: the step's flat floats."""

    TYPE: ClassVar[str] = "trainer.step"
    step: int
    version: int
    metrics: dict[str, float]


@dataclass(frozen=True, eq=False)
class GroupsDropped(Message):
    """The packer dropped ``group_ids`` untrained for ``reason`` (e.g. ``"stale"``)."""

    TYPE: ClassVar[str] = "groups.dropped"
    group_ids: list[str]
    reason: str


@dataclass(frozen=True, eq=False)
class GroupsTrained(Message):
    """A checkpoint covers 0-based ``step``: its ``group_ids`` are durably trained. Id
    ``trained-step-{step}``: a resumed trainer announces it again, so receivers are idempotent."""

    TYPE: ClassVar[str] = "groups.trained"
    step: int
    group_ids: list[str]


@dataclass(frozen=True, eq=False)
class RunDone(Message):
    """The trainer stopped after ``step`` (``reason``: ``"max_steps"`` or the failure)."""

    TYPE: ClassVar[str] = "run.done"
    step: int
    reason: str


@dataclass(frozen=True, eq=False)
class RunFinish(Message):
    """``busctl down --finish`` -> prompt source: end the run after the steps whose prompts are issued."""

    TYPE: ClassVar[str] = "run.finish"


@dataclass(frozen=True, eq=False)
class RunFinalStep(Message):
    """Prompt source -> all: the run now ends after ``step`` optimizer steps (was ``trainer.max_steps``)."""

    TYPE: ClassVar[str] = "run.final_step"
    step: int


@dataclass(frozen=True, eq=False)
class ServersWanted(Message):
    """``busctl scale servers=N`` -> producers on inference servers they start: run ``servers`` each. ``id`` is the
    request's (resent until answered; the hub keeps the last for restarted producers)."""

    TYPE: ClassVar[str] = "servers.wanted"
    servers: int


@dataclass(frozen=True, eq=False)
class ServersScaled(Message):
    """Producer -> supervisor: ``producer`` runs ``servers`` servers in sync for request ``request``, or failed
    (``error`` non-empty)."""

    TYPE: ClassVar[str] = "servers.scaled"
    producer: str
    request: str
    servers: int
    error: str = optional_field("")


@dataclass(frozen=True, eq=False)
class ComponentReady(Message):
    """Startup handshake, component -> supervisor; ``metrics_host`` ``""`` means 127.0.0.1."""

    TYPE: ClassVar[str] = "component.ready"
    name: str
    pid: int
    metrics_port: int
    metrics_host: str = optional_field("")


class ComponentPhase(StrEnum):
    """A component's ``/health`` phase; ``running`` or ``done`` is its heartbeat state."""

    STARTING = "starting"  # in setup, before the ready handshake
    RUNNING = "running"
    DONE = "done"  # run() returned; it serves metrics until stopped
    FAILED = "failed"


@dataclass(frozen=True, eq=False)
class ComponentHeartbeat(Message):
    """Liveness, component -> supervisor, every ``bus.heartbeat_s``; ``state``: running or done; ``failures``:
    :meth:`telemetry.failure_window.FailureWindows.report` (``{function: {kind, calls, errors, share, window,
    error, message, level}}``), ``{}`` without failures."""

    TYPE: ClassVar[str] = "component.heartbeat"
    name: str
    pid: int
    state: str
    failures: dict = optional_field({}, may_be_absent=True)

    def check(self) -> None:
        for key, rec in self.failures.items():
            if not (isinstance(key, str) and isinstance(rec, dict) and _FAILURE_FIELDS.keys() <= rec.keys()):
                raise WireError("inconsistent", "component.heartbeat.failures: malformed record")
            for field_name, types in _FAILURE_FIELDS.items():
                if not isinstance(rec[field_name], types) or isinstance(rec[field_name], bool):
                    raise WireError("inconsistent", f"component.heartbeat.failures: {field_name} not {types}")


_FAILURE_FIELDS = {
    "kind": str,
    "calls": int,
    "errors": int,
    "share": (int, float),
    "window": int,
    "error": str,
    "message": str,
    "level": str,
}


@dataclass(frozen=True, eq=False)
class EvalResult(Message):
    """One eval task's result of eval ``round`` (the policy version evaluated), packer -> trainer.

    ``version_min``/``version_max``: the versions that produced the round's tokens; ``num_samples`` scored,
    ``num_failed`` groups failed; ``metrics``: ``reward_mean``, ``pass_at_1``, ... (floats)."""

    TYPE: ClassVar[str] = "eval.result"
    round: int
    task: str
    version_min: int
    version_max: int
    num_samples: int
    num_failed: int
    metrics: dict[str, float]
