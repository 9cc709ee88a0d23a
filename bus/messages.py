"""Every message type that travels on the rlbus bus, in one module.

Each type is a frozen dataclass with a ``TYPE`` string; scalar fields travel in the msgpack
header, fields declared with :func:`bus.wire.array_field` travel as raw frames (see
:mod:`bus.wire`). :mod:`bus.codec` encodes and decodes them: ``decode`` validates every field and
then calls the type's ``check()`` (cross-field consistency, raising
``bus.wire.WireError("inconsistent")``). :data:`bus.registry.MESSAGE_TYPES` registers every type (others raise).

Data topics carry one *group* per message on ``rollouts`` and ``scored`` so that any reward
worker can compute a group's advantages alone.
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
    """Base of all message types.

    Fields:
        id: unique id of this message (a group id on data topics; consumers dedupe by it).
    """

    TYPE: ClassVar[str] = ""
    id: str

    def check(self) -> None:
        """Cross-field consistency checks of a decoded message; raises ``WireError('inconsistent')``."""

    @classmethod
    def array_specs(cls) -> dict[str, ArraySpec]:
        return {f.name: f.metadata["array"] for f in dataclasses.fields(cls) if "array" in f.metadata}


# ------------------------------------------------------------------------------------------------
# Data topics
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Prompt(Message):
    """One prompt, from the prompt source to a rollout producer (topic ``prompts``).

    Fields:
        index: position of the prompt in the issue order (0, 1, 2, ...).
        step: the optimizer step this prompt was issued for (gating: issued only while
            ``trainer_version >= step - max_async_level``).
        task: task name, selects the reward function downstream.
        messages: chat messages ``[{"role": str, "content": str}, ...]`` to render with the
            policy's chat template.
        info: task data for the verifier (e.g. ``{"target": "cba"}``); JSON-like values only.
        temperature: sampling temperature for this prompt (``sampling.temperature`` or the
            ``sampling.temp_scheduler`` value at ``step``; the eval temperature for eval prompts).
        eval_round: ``-1`` for a training prompt; else the policy version whose online evaluation
            this prompt belongs to (see :mod:`producers.evaluation`). Eval prompts never train.
        eval_size: groups in the whole eval round (every eval task), ``0`` for a training prompt.
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
    """The G completions of one prompt, from a producer to a reward worker (topic ``rollouts``).

    ``id`` is the prompt id. Sample ``j`` owns ``completion_ids[offsets[j]:offsets[j+1]]`` where
    ``offsets = [0, *cumsum(completion_lens)]``.

    Fields:
        prompt_index, step, task, info: copied from the :class:`Prompt`.
        producer: name of the producer that sampled the group.
        completion_texts: ``[G]`` decoded completions.
        finish_reasons: ``[G]`` vLLM finish reasons (``"stop"``, ``"length"``, ...).
        prompt_ids: ``[P] int32`` prompt token ids (chat template applied).
        completion_ids: ``[N] int32`` all completions' token ids, concatenated (N = sum of lens).
        completion_lens: ``[G] int32`` tokens per completion.
        sampler_logprobs: ``[N] float32`` log-probability of each sampled token under the sampling policy
            (nats, after temperature scaling if the sampler used one).
        version_start: ``[G] int64`` oldest policy version that sampled a token of the sample.
        version_end: ``[G] int64`` newest one (both the min / max of the sample's spans).
        version_spans: ``[M, 2] int64`` ``(version, num_tokens)`` runs of each sample's tokens, in
            order; version_span_counts: ``[G] int32`` runs per sample; both empty when the sender
            knows no spans (checks and helpers: :mod:`bus.sample_arrays`).
        gen_time_s: wall time the producer spent generating the group, seconds.
        temperature, eval_round, eval_size: copied from the :class:`Prompt`.
        teacher_logprobs: ``[N] float32`` logprob of each completion token under the teacher model
            (nats, temperature 1), or ``[0]`` without a teacher.
        prompt_text: the rendered prompt (chat template applied) the producer sampled from, for
            the run's ``samples.jsonl``; ``""`` from senders that do not fill it.
        loss_mask: ``[N] bool`` multi-turn episodes: True on model-sampled tokens, False on the
            environment's (template-rendered; logprob 0); ``[0]``: every token is the model's.
        env_rewards: ``[G] float32`` each episode's environment reward (the term ``env``), or ``[0]``.
        prompt_messages: the prompt's chat messages ``[{"role": str, "content": str}, ...]`` as the
            :class:`Prompt` carried them (before the chat template; a multi-turn episode's or an
            agent's *initial* messages, without the environment's turns), once per group, for TRL
            conversational reward functions (:mod:`tasks.trl_rewards`); ``[]`` when the sender
            has none. Exactly those two string keys per message, else the group is rejected
            (``field``); absent from an older sender's header, it decodes as ``[]``.
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
    """A :class:`RolloutGroup` with rewards and advantages, from a reward worker to the packer
    (topic ``scored``).

    Fields:
        reward_worker: name of the worker that scored the group.
        rewards: ``[G] float32`` reward of each completion (the weighted sum of the task's reward
            functions).
        advantages: ``[G] float32`` group-relative advantage of each completion.
        reward_terms: ``{reward function name: [G] floats}`` each function's own (unweighted) score.
        flags: ``[G]`` comma-separated names of the filters that flagged each sample (``""`` when
            none), or ``[]`` when no filter ran.
        masked: ``[G] bool`` True for a sample the loss must not use (flagged by an enforced
            filter), or ``[0]`` for none.
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
    """One packed, padding-free micro-batch, from the packer to the trainer (topic ``batches``).

    The ``S`` samples are concatenated into one row of ``T`` tokens; sample ``k`` is
    ``prompt + completion`` and its positions restart at 0. ``id`` is ``"{step}:{micro_index}"``.

    Fields:
        step: optimizer step this micro-batch belongs to (0-based).
        micro_index: index of this micro-batch within the step.
        num_micro_batches: micro-batches in the step; the trainer steps after the last one.
        step_loss_tokens: loss tokens in the whole step (normalizer of the token-mean loss).
        step_samples: samples of the whole step with at least one loss token (normalizer of the
            sequence-mean aggregations, see :mod:`trainer.losses`).
        sample_ids: ``[S]`` ``"{group_id}/{j}"`` ids of the packed samples.
        input_ids: ``[T] int32`` packed token ids.
        seq_lens: ``[S] int32`` tokens per sample (sum = T).
        loss_mask: ``[T] bool`` True on completion tokens that the loss uses.
        sampler_logprobs: ``[T] float32`` sampler logprob of each completion token (0 elsewhere).
        advantages: ``[T] float32`` the sample's advantage on each of its tokens.
        rewards: ``[S] float32`` reward of each sample.
        oldest_versions: ``[S] int64`` oldest policy version each sample was generated under.
        token_versions: ``[T] int64`` policy version that sampled each completion token (prompt
            tokens: the sample's oldest version); checks in :mod:`bus.sample_arrays`.
        teacher_logprobs: ``[T] float32`` logprob of each completion token under a teacher model
            (on-policy distillation), or ``[0]`` when the samples carry none.
        temperature: the sampling temperature of every sample here (the packer never mixes two);
            the trainer divides the logits by it.
        reward_terms: ``{reward function name: [S] floats}`` each sample's per-function score.
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
    """Announces new policy weights (broadcaster -> producers, control channel).

    Fields:
        version: the new policy version (= optimizer steps taken).
        method: ``"broadcast"`` (torch.distributed, tensors follow in ``manifest`` order),
            ``"filesystem"`` (a safetensors directory at ``path`` with a READY marker) or ``"bus"``
            (producers pull the buckets from the ``weights`` endpoint, :mod:`broadcaster.bus_method`).
        manifest: ``[[name, dtype, shape], ...]`` tensors in broadcast order (HF names): full
            weights, or a LoRA adapter (``M.lora_A.weight``, ``M.lora_B.weight``,
            ``M.lora_scaling`` per adapted module, plus whole RMSNorm weights when QeRL noise is
            on) that the producer merges into its base weights; see :mod:`broadcaster.manifest`.
        path: directory of the weights for ``filesystem``; ``""`` otherwise.
        num_bytes: payload size, bytes.
    """

    TYPE: ClassVar[str] = "weights.ready"
    version: int
    method: str
    manifest: list
    path: str
    num_bytes: int


@dataclass(frozen=True, eq=False)
class WeightsApplied(Message):
    """A producer has loaded ``version`` and tags later tokens with it (control channel).

    Fields:
        producer: producer name. version: the version now in effect.
        apply_time_s: pause + receive + load + resume, seconds.
    """

    TYPE: ClassVar[str] = "weights.applied"
    producer: str
    version: int
    apply_time_s: float


@dataclass(frozen=True, eq=False)
class WeightsWanted(Message):
    """A late-joining producer (outside the weight group) skipped broadcast ``version`` and waits
    for filesystem weights (control channel): the trainer switches to the filesystem method."""

    TYPE: ClassVar[str] = "weights.wanted"
    producer: str
    version: int


@dataclass(frozen=True, eq=False)
class TrainerStep(Message):
    """The trainer finished optimizer step ``step`` and is now at policy ``version``.

    Fields:
        metrics: the step's flat metrics (``reward_mean``, ``loss``, ``kl``, ...; floats).
    """

    TYPE: ClassVar[str] = "trainer.step"
    step: int
    version: int
    metrics: dict[str, float]


@dataclass(frozen=True, eq=False)
class GroupsDropped(Message):
    """The packer dropped groups (never trained); the prompt source issues replacements.

    Fields:
        group_ids: ids of the dropped groups. reason: e.g. ``"stale"``.
    """

    TYPE: ClassVar[str] = "groups.dropped"
    group_ids: list[str]
    reason: str


@dataclass(frozen=True, eq=False)
class GroupsTrained(Message):
    """The trainer's checkpoint now covers step ``step``: its groups are durably trained
    (outcome ``trained``). Announced when a checkpoint covers the step; a resumed trainer
    announces the steps released with its checkpoint again, with the same id
    ``trained-step-{step}``, so receivers treat repeats idempotently.

    Fields:
        step: the 0-based optimizer step. group_ids: ids of the groups trained in it.
    """

    TYPE: ClassVar[str] = "groups.trained"
    step: int
    group_ids: list[str]


@dataclass(frozen=True, eq=False)
class RunDone(Message):
    """The trainer reached ``max_steps`` (or stopped); components drain and exit.

    Fields:
        step: last step trained. reason: ``"max_steps"`` or a failure description.
    """

    TYPE: ClassVar[str] = "run.done"
    step: int
    reason: str


@dataclass(frozen=True, eq=False)
class ComponentReady(Message):
    """Startup handshake, component -> supervisor: set up and serving.

    Fields:
        name: component name (e.g. ``"rewards-1"``). pid: process id.
        metrics_port: TCP port of its Prometheus ``/metrics`` endpoint.
        metrics_host: the address it serves them on (``""``: 127.0.0.1; a node's address when
            the run spans several nodes, :mod:`lifecycle.launch_env`).
    """

    TYPE: ClassVar[str] = "component.ready"
    name: str
    pid: int
    metrics_port: int
    metrics_host: str = optional_field("")


class ComponentPhase(StrEnum):
    """Where a component process is (:mod:`bus.component`): the ``phase`` of its ``/health`` body,
    and, ``running`` or ``done``, the ``state`` of its :class:`ComponentHeartbeat`."""

    STARTING = "starting"
    """In ``setup``, before its ready handshake."""
    RUNNING = "running"
    DONE = "done"
    """``run()`` returned: its work for the run is done (it keeps serving metrics until stopped)."""
    FAILED = "failed"


@dataclass(frozen=True, eq=False)
class ComponentHeartbeat(Message):
    """Liveness, component -> supervisor, every ``bus.heartbeat_s``.

    Fields:
        name: component name. pid: process id. state: :class:`ComponentPhase` ``"running"`` or ``"done"``.
    """

    TYPE: ClassVar[str] = "component.heartbeat"
    name: str
    pid: int
    state: str


@dataclass(frozen=True, eq=False)
class EvalResult(Message):
    """One eval task's result in one online-evaluation round, packer -> trainer (control channel).

    Fields:
        round: the policy version the round evaluates (0: the base model).
        task: eval task name.
        version_min, version_max: oldest / newest policy version that actually produced a token of
            the round's samples (equal to ``round`` unless the producers were already ahead).
        num_samples: completions scored. num_failed: groups whose generation failed (no samples).
        metrics: ``reward_mean``, ``reward_std``, ``completion_len_mean``, ``pass_at_1`` ... (floats).
    """

    TYPE: ClassVar[str] = "eval.result"
    round: int
    task: str
    version_min: int
    version_max: int
    num_samples: int
    num_failed: int
    metrics: dict[str, float]
