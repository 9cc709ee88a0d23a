"""The trainer's logic: one optimizer step from a list of packed micro-batches.

Gradients are accumulated over the step's micro-batches; each micro-batch loss is already
normalized by step-wide totals (``MicroBatch.step_loss_tokens`` and ``step_samples``), so their
sum is the step's loss under the configured aggregation whatever the split into micro-batches
and data-parallel ranks (see :mod:`trainer.losses`; tested in float64 by
``tests/trainer/test_invariance.py``). Then the gradient norm is clipped and AdamW steps with the
learning rate of ``trainer.optim``'s schedule (:mod:`trainer.optim.lr_schedule`; the scheduler steps
after every step, skipped ones too, so step ``s`` always trains with the schedule's rate at ``s``).
No sockets here (see :mod:`trainer.proc`).

The host never waits for the device inside the micro-batch loop: each micro-batch's checks,
indices and counts come from its host arrays (:mod:`trainer.forward.packed_row`,
:func:`trainer.losses.check_loss_inputs`, :func:`trainer.observability.step_stats.host_micro_stats`),
its arrays go over with queued copies (:mod:`trainer.kernels.transfer`), its loss stats stay on the
device until the step reads all of them back at once, and phase times are CUDA events
(:class:`trainer.observability.step_timing.PhaseMarks`). So on a GPU the host queues micro-batch
k + 1's kernels while the device runs micro-batch k's. A step reads the device back twice: the
stats of every micro-batch and the gradient norm (tests/trainer/test_host_sync.py).

Precision (``trainer.dtype``, :mod:`trainer.forward.precision`): the policy's and the reference's forwards
run under the policy's autocast context (bfloat16 matmuls with ``trainer.dtype: bfloat16``); the
parameters, gradients, AdamW state, logprobs and the loss stay float32.

Temperature: each micro-batch carries the temperature its samples were sampled at
(``MicroBatch.temperature``; the packer never mixes two), and the policy's and the reference's
logprobs of that micro-batch divide the logits by it, so they are the quantity the sampler
reported (vLLM ``processed_logprobs``), whatever the temperature schedule.

Non-finite guard: if any micro-batch loss or the gradient norm is NaN/inf, the optimizer step is
skipped: gradients are dropped, weights and AdamW state (moments, step count) stay bit-identical,
``rlbus_trainer_skipped_steps_total{reason}`` grows, and the metrics say ``skipped: 1.0``. The
caller still advances the policy version and broadcasts the (unchanged) weights: every step of
the pipeline then means one version, so the prompt source's gating, the packer's staleness check
and the producers stay in lockstep with no "step without a version" case to handle anywhere.
The micro-batches of a skipped step count as trained (they were consumed, not lost).
"""

from __future__ import annotations

import gc
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from prometheus_client import Counter

from bus.messages import MicroBatch
from configs.schema import RunConfig, TrainerConfig
from trainer.losses import LossBatch, LossSpec, StepNorm, check_loss_inputs, policy_loss_terms
from trainer.parallel.distributed import DataParallel
from trainer.observability.step_stats import host_micro_stats, merge_stats, read_back, step_metrics
from trainer.forward.compiled import compile_decoder_layers
from trainer.forward.packed import PackedLogprobs
from trainer.kernels.transfer import to_device
from trainer.forward.precision import PrecisionPolicy
from trainer.forward.reference import ReferencePolicy
from trainer.optim.lr_schedule import build_lr_scheduler, rebind_lr_scheduler
from trainer.parallel.sharding import clip_grad_norm, enable_activation_checkpointing, shard_keeping_optimizer_state
from trainer.observability.step_timing import PhaseMarks, phase_key

log = logging.getLogger(__name__)

SKIPPED_STEPS = Counter(
    "rlbus_trainer_skipped_steps_total",
    "Optimizer steps skipped because the loss or gradient norm was NaN/inf, by reason",
    ["reason"],
)
SKIP_REASONS = ("non_finite_loss", "non_finite_grad")
for _reason in SKIP_REASONS:  # export both series from the start, at 0
    SKIPPED_STEPS.labels(reason=_reason)


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all weights, or the LoRA adapter).

    torch's fused kernel (one pass over all parameters) when every parameter is a plain float
    tensor: the same update as the per-tensor loop, ~10x faster on CPU (0.7 vs 7.6 ms per step
    for the default policy, 1 thread). FSDP2's sharded DTensor parameters keep the default loop.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    plain = all(type(p) is torch.nn.Parameter and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=plain and bool(params))


def build_trainer(model: torch.nn.Module, cfg: RunConfig) -> "Trainer":
    """The run's :class:`Trainer`: the trainer section and the sampler's ``max_tokens`` (Dr.
    GRPO's normalizer); the temperature comes with each micro-batch."""
    return Trainer(model, cfg.trainer, max_tokens=cfg.sampling.max_tokens)


class Trainer:
    """Takes optimizer steps on the policy.

    Args:
        model: HF causal LM (possibly peft-wrapped), float32, in train mode.
        cfg: the trainer section of the run config (``cfg.dtype``: the forwards' compute dtype,
            :class:`trainer.forward.precision.PrecisionPolicy`).
        max_tokens: the sampler's ``max_tokens`` (needed by ``seq_mean_token_sum_norm`` only).

    Each micro-batch's logits are divided by its ``MicroBatch.temperature`` before log-softmax
    (see the module docstring).

    Raises:
        ValueError: aggregation ``seq_mean_token_sum_norm`` without ``max_tokens``.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, max_tokens: int | None = None) -> None:
        self.model = model
        self.cfg = cfg
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.max_steps)
        """The learning-rate schedule (stepped once per :meth:`step`; checkpointed as ``scheduler.pt``)."""
        self.logprobs: torch.nn.Module = PackedLogprobs(
            model, share_prefixes=cfg.share_prefixes, head_dtype=cfg.lm_head_dtype
        )
        """The packed forward (wrapped in DDP, or sharded in place by FSDP2, by
        :meth:`enable_data_parallel`); its temperature
        is set per micro-batch (:meth:`set_temperature`)."""
        self.loss_spec = LossSpec.from_config(cfg.loss)
        if self.loss_spec.aggregation == "seq_mean_token_sum_norm" and max_tokens is None:
            raise ValueError("aggregation seq_mean_token_sum_norm needs max_tokens (the sampler's sampling.max_tokens)")
        self.max_tokens = max_tokens if max_tokens is not None else 1
        """Dr. GRPO's constant normalizer (tokens); only seq_mean_token_sum_norm uses it."""
        needs_reference = self.loss_spec.kl_tau > 0 and self.loss_spec.kl_reference == "reference"
        self.reference = (
            ReferencePolicy(model, share_prefixes=cfg.share_prefixes, head_dtype=cfg.lm_head_dtype)
            if needs_reference
            else None
        )
        """The frozen start policy of the KL penalty, built before any step (None: not used)."""
        self.precision = PrecisionPolicy.from_name(cfg.dtype)
        """The compute dtype of the policy's and the reference's forwards (``trainer.dtype``,
        :mod:`trainer.forward.precision`): parameters, gradients and AdamW state stay float32."""
        if cfg.compile:  # after the reference's copy: the frozen reference stays eager
            compile_decoder_layers(model, cfg.compile_backend)
        self.phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        """Seconds of the current (or last) :meth:`step` per phase (:mod:`trainer.observability.step_timing`)."""

    def micro_step(self, mb: MicroBatch) -> tuple[float, dict[str, float]]:
        """Forward + backward of one micro-batch; returns its loss contribution and loss stats.

        The loss is :func:`trainer.losses.policy_loss` with the step-wide normalizers the packer
        wrote into every micro-batch of the step (``step_loss_tokens``, ``step_samples``), so the
        step's gradient does not depend on how its samples were split into micro-batches or ranks.
        Inputs besides the policy's own logprobs: the sampler's (``sampler_logprobs``), the
        old policy's when ``use_tis`` (rlbus takes ONE optimizer step per batch, so the old policy
        is the weights at the start of this step: ``train_logprobs.detach()`` exactly), the frozen
        reference's when ``kl_reference: reference``, and the teacher's when the samples carry them.

        Besides the loss stats, reports ``onpolicy_tokens`` and ``onpolicy_lp_diff_max``: the
        largest ``|train_logprobs - sampler_logprobs|`` over loss tokens generated under exactly
        the weights being trained (``token_versions == step``; a partial rollout's later tokens
        count, its earlier ones do not). Those must agree up to numerics; a large value means the
        producers do not run the trainer's weights. And ``lag_tokens/<bucket>``: loss tokens per
        off-policy lag (:func:`trainer.observability.lag_stats.lag_token_counts`), and the rest of
        :func:`trainer.observability.step_stats.host_micro_stats`.

        Reads its results back from the device once; :meth:`step` runs the same work
        (:meth:`_queue_micro_batch`) for every micro-batch and reads them all back at the end.

        Raises:
            ValueError: the micro-batch's lengths, step normalizers or inputs are bad
                (:func:`trainer.losses.check_loss_inputs`, :class:`trainer.forward.packed_row.PackedRow`).
        """
        marks = PhaseMarks(self._device())
        device_stats, host_stats = self._queue_micro_batch(mb, marks)
        stats = {**host_stats, **read_back([device_stats])[0]}
        self._add_phase_times(marks, 0)
        return stats.pop("loss"), stats

    def _queue_micro_batch(self, mb: MicroBatch, marks: PhaseMarks) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Queue one micro-batch's forward, loss and backward on the device without waiting for it.

        Everything that needs the micro-batch's values on the host (checks, indices, counts) is
        computed from its host arrays (:mod:`trainer.forward.packed_row`,
        :func:`trainer.losses.check_loss_inputs`, :func:`trainer.observability.step_stats.host_micro_stats`)
        and copied over with :func:`trainer.kernels.transfer.to_device`; the loss and its stats stay
        on the device. Marks three points on ``marks`` (start, forward done, backward done).

        Returns:
            (device stats ``{name: 0-dim tensor}`` with ``loss`` and ``onpolicy_lp_diff_max``,
            host stats ``{name: float}``).
        """
        device = self._device()
        marks.mark()
        ids = np.asarray(mb.input_ids, dtype=np.int64)
        lens = np.asarray(mb.seq_lens, dtype=np.int64)
        mask = np.asarray(mb.loss_mask, dtype=bool)
        teacher = mb.teacher_logprobs if len(mb.teacher_logprobs) else None
        norm = StepNorm(loss_tokens=mb.step_loss_tokens, num_samples=mb.step_samples, max_tokens=self.max_tokens)
        check_loss_inputs(
            mask,
            lens,
            norm,
            {"sampler_logprobs": mb.sampler_logprobs, "advantages": mb.advantages, "teacher_logprobs": teacher},
        )
        host_stats = host_micro_stats(mb)
        loss_mask = to_device(mask, device)
        sampler_logprobs = to_device(mb.sampler_logprobs, device, torch.float32)
        on_policy = to_device(mask & (np.asarray(mb.token_versions) == mb.step), device)
        self.set_temperature(mb.temperature)
        with self.precision.autocast(device):  # the forwards only; the loss below is float32
            # only the loss tokens: the loss, its statistics and the on-policy check read nothing else
            train_logprobs, entropy = self.logprobs(ids, lens, mask)
            ref_logprobs = self.reference.logprobs(ids, lens, mb.temperature, mask) if self.reference else None
        spec = self.loss_spec
        batch = LossBatch(
            train_logprobs=train_logprobs,
            sampler_logprobs=sampler_logprobs,
            advantages=to_device(mb.advantages, device, torch.float32),
            loss_mask=loss_mask,
            seq_lens=to_device(lens, device),
            old_logprobs=train_logprobs.detach() if spec.use_tis else None,
            ref_logprobs=ref_logprobs.to(train_logprobs.dtype) if ref_logprobs is not None else None,
            teacher_logprobs=to_device(teacher, device, torch.float32) if teacher is not None else None,
            entropy=entropy.to(train_logprobs.dtype),
            checked=True,
        )
        loss, device_stats = policy_loss_terms(batch, norm, spec)
        marks.mark()
        loss.backward()
        marks.mark()
        diff = (train_logprobs.detach() - sampler_logprobs).abs()
        device_stats["loss"] = loss.detach()
        device_stats["onpolicy_lp_diff_max"] = (
            torch.where(on_policy, diff, 0.0).amax() if len(diff) else diff.new_zeros(())
        )
        host_stats["decoder_tokens"] = self._packed().stats["decoder_tokens"]
        return device_stats, host_stats

    def _device(self) -> torch.device:
        """The policy's device."""
        return next(self.model.parameters()).device

    def set_temperature(self, temperature: float) -> None:
        """Divide the logits of the next packed forwards by ``temperature`` (> 0).

        Raises:
            ValueError: temperature is not a finite number > 0.
        """
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"micro-batch temperature must be a finite number > 0, got {temperature!r}")
        self._packed().temperature = float(temperature)

    def _packed(self) -> PackedLogprobs:
        """The packed forward module, inside its DDP wrapper if any."""
        ddp = torch.nn.parallel.DistributedDataParallel
        return self.logprobs.module if isinstance(self.logprobs, ddp) else self.logprobs

    before_micro_batch: Callable[[], None] | None = None
    """Called before each micro-batch of :meth:`step` (the process sets the thread count there,
    :mod:`trainer.parallel.threads`); None: nothing."""

    dp: DataParallel | None = None
    """This rank's data-parallel group, set by :meth:`enable_data_parallel` (None: one rank)."""

    def enable_data_parallel(self, dp: DataParallel) -> None:
        """Train as one rank of ``dp``: the packed forward runs in DDP (gradients summed over
        ranks, see :mod:`trainer.parallel.distributed`), or with ``parallel: fsdp`` is sharded by FSDP2
        (:mod:`trainer.parallel.sharding`; the optimizer is rebuilt over the sharded parameters and keeps
        its state), and :meth:`step` reduces its stats over ranks.

        A collective: call it on every rank, each with the same weights and optimizer state (DDP's
        constructor also broadcasts rank 0's parameters).
        """
        self.dp = dp
        if self.cfg.parallel == "fsdp":

            def build() -> torch.optim.Optimizer:  # scheduled before the state load: its groups have initial_lr too
                optimizer = build_optimizer(self.model, self.cfg)
                self.scheduler = rebind_lr_scheduler(self.scheduler, optimizer, self.cfg.optim, self.cfg.max_steps)
                return optimizer

            self.optimizer = shard_keeping_optimizer_state(
                self.logprobs,
                self.optimizer,
                build,
                dp.device,
                dp.world_size,
                bfloat16=self.cfg.dtype == "bfloat16",
            )
        else:
            self.logprobs = dp.wrap(self.logprobs)

    def disable_data_parallel(self) -> None:
        """Back to one rank: unwrap the DDP module and free its reducer (idempotent). An FSDP2
        model stays sharded (its weights are DTensors over the group): train no more with it.

        Call it before ``DataParallel.close``: a reducer that outlives the group frees the group's
        last reference from C++ with the GIL held, and gloo's destructor then waits for worker
        threads that need the GIL (a deadlock at exit, pytorch/pytorch#56297).
        """
        if self.dp is None:
            return
        if isinstance(self.logprobs, torch.nn.parallel.DistributedDataParallel):
            self.logprobs = self.logprobs.module
        self.dp = None
        gc.collect()  # the reducer goes now, not at some later collection

    def padding_micro_step(self, marks: PhaseMarks | None = None) -> None:
        """Forward + backward with zero loss, for a padding slot of a data-parallel step.

        Every trainable parameter gets a zero gradient through the same DDP module, so this rank
        runs as many forwards and backwards as the others and joins the gradient all-reduce; its
        accumulated gradient is unchanged (``0 * logprobs``; a non-finite forward would still
        poison it, and then the step is skipped on every rank anyway). ``marks``: the step's
        phase marks (three are added), or None.
        """
        marks = marks if marks is not None else PhaseMarks(self._device())
        marks.mark()
        with self.precision.autocast(self._device()):
            lp, _entropy = self.logprobs(np.zeros(2, np.int64), np.array([2]))
        marks.mark()
        (lp.sum() * 0.0).backward()
        marks.mark()

    def _add_phase_times(self, marks: PhaseMarks, first: int) -> None:
        """Charge the micro-batch whose three marks start at index ``first`` of ``marks`` to the
        step's forward (first -> first + 1) and backward (-> first + 2) seconds."""
        self.phase_s["forward"] += marks.seconds(first, first + 1)
        self.phase_s["backward"] += marks.seconds(first + 1, first + 2)

    def step(self, micro_batches: Sequence[MicroBatch | None]) -> dict[str, float]:
        """One optimizer step over a step's micro-batches (with data parallelism: this rank's share,
        padded with ``None`` slots; :mod:`trainer.parallel.distributed`).

        Gradients accumulate over the micro-batches (DDP all-reduces in the last backward); the
        stats merge over micro-batches, then ranks, so every rank reports the whole step and skips
        (non-finite loss or gradient) or steps alike.

        Returns:
            The step's metrics; their keys are the rows of :data:`trainer.observability.step_keys.STEP_KEYS`.

        Raises:
            ValueError: no slots, micro-batches of several steps, padding slots without data
                parallelism, or (one rank) no micro-batch at all.
        """
        real = [mb for mb in micro_batches if mb is not None]
        if not micro_batches or len({mb.step for mb in real}) > 1 or (self.dp is None and not real):
            raise ValueError("a step needs its micro-batches, all of one step")
        if self.dp is None and len(real) < len(micro_batches):
            raise ValueError("padding slots (None) are for data-parallel steps; call enable_data_parallel first")
        started = time.perf_counter()
        self.phase_s = dict.fromkeys(self.phase_s, 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        marks = PhaseMarks(self._device())
        queued: list[
            tuple[dict[str, torch.Tensor], dict[str, float]]
        ] = []  # (device stats, host stats) per micro-batch
        last = len(micro_batches) - 1
        for k, mb in enumerate(micro_batches):
            if self.before_micro_batch is not None:
                self.before_micro_batch()
            with DataParallel.grad_sync(self.logprobs, sync=k == last):
                if mb is None:
                    self.padding_micro_step(marks)
                    continue
                queued.append(self._queue_micro_batch(mb, marks))
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizing = marks.mark()
        grad_norm = clip_grad_norm(params, self.cfg.optim.max_grad_norm)  # over the shards with fsdp
        totals: dict[str, float] = {}
        read = read_back(
            [device_stats for device_stats, _host in queued]
        )  # the step's one read-back of the micro-batches' stats
        for (_device, host_stats), device_stats in zip(queued, read):
            stats = {**host_stats, **device_stats}
            stats["non_finite_losses"] = float(not math.isfinite(stats["loss"]))
            totals = merge_stats(totals, stats)
        totals["non_finite_grad_max"] = float(not math.isfinite(grad_norm))
        if self.dp is not None:  # the whole step's stats, merged in rank order: identical on every rank
            merged: dict[str, float] = {}
            for rank_totals in self.dp.all_gather_stats(totals):
                merged = merge_stats(merged, rank_totals)
            totals = merged
        reason, lr = None, float(self.optimizer.param_groups[0]["lr"])
        if totals.get("non_finite_losses", 0.0):
            reason = "non_finite_loss"
        elif totals["non_finite_grad_max"]:
            reason = "non_finite_grad"
        if reason is None:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            SKIPPED_STEPS.labels(reason=reason).inc()
            log.warning(
                "step %s: skipped the optimizer step (%s: loss %s, grad norm %s); weights unchanged",
                real[0].step if real else "?",
                reason,
                totals.get("loss"),
                grad_norm,
            )
        with (
            warnings.catch_warnings()
        ):  # a skipped FIRST step: torch warns that optimizer.step() never ran; by design here
            warnings.filterwarnings(
                "ignore", message="Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"
            )
            self.scheduler.step()  # skipped steps too: the rate is a function of the step (module docstring)
        self.phase_s["optimizer"] = marks.seconds(optimizing, marks.mark())
        for first in range(0, optimizing, 3):  # three marks per micro-batch or padding slot
            self._add_phase_times(marks, first)
        metrics = step_metrics(totals, grad_norm, time.perf_counter() - started, skipped=reason is not None)
        metrics["lr"] = lr
        metrics.update({phase_key(phase): seconds for phase, seconds in self.phase_s.items()})  # this rank's
        return metrics
