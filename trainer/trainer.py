"""The trainer's logic, socket-free: one optimizer step (AdamW, clipped gradient norm, the LR schedule
of ``trainer.optim``) over a step's packed micro-batches. Split invariance, no host sync in the
micro-batch loop, per-micro-batch temperature and the non-finite guard: docs/ARCHITECTURE.md,
"Trainer math" and "Failure containment".
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
    """AdamW over the trainable parameters (all weights, or the LoRA adapter): torch's fused
    kernel when every parameter is a plain float tensor (~10x faster on CPU, bench/README.md), the
    per-tensor loop for FSDP2's DTensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    plain = all(type(p) is torch.nn.Parameter and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=plain and bool(params))


def build_trainer(model: torch.nn.Module, cfg: RunConfig) -> "Trainer":
    """The run's :class:`Trainer` (the sampler's ``max_tokens`` is Dr. GRPO's normalizer)."""
    return Trainer(model, cfg.trainer, max_tokens=cfg.sampling.max_tokens)


class Trainer:
    """Takes optimizer steps on ``model`` (an HF causal LM, possibly peft-wrapped, float32, train
    mode) with the trainer section ``cfg``; ``max_tokens``: the sampler's, needed by
    ``seq_mean_token_sum_norm`` only (ValueError without it)."""

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
        """Forward + backward of one micro-batch, read back at once; returns its loss contribution
        and stats (host counts, loss terms, ``onpolicy_lp_diff_max``: the largest ``|train - sampler
        logprob|`` over tokens sampled by these very weights). ValueError for bad inputs."""
        marks = PhaseMarks(self._device())
        device_stats, host_stats = self._queue_micro_batch(mb, marks)
        stats = {**host_stats, **read_back([device_stats])[0]}
        self._add_phase_times(marks, 0)
        return stats.pop("loss"), stats

    def _queue_micro_batch(self, mb: MicroBatch, marks: PhaseMarks) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Queue one micro-batch's forward, loss and backward without a host sync; returns (device
        stats, host stats) and adds three marks (start, forward done, backward done)."""
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
        """Divide the next packed forwards' logits by ``temperature`` (ValueError unless finite > 0)."""
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
        """Train as one rank of ``dp`` (a collective: every rank, with the same weights and
        optimizer state): DDP around the packed forward, or with ``parallel: fsdp`` FSDP2 shards (the
        optimizer rebuilt over them, its state kept); :meth:`step` then reduces stats over ranks."""
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
        """Back to one rank: unwrap DDP and free its reducer (idempotent; an FSDP2 model stays
        sharded). Call it before ``DataParallel.close``: a reducer outliving the group deadlocks
        gloo's destructor at exit (pytorch/pytorch#56297)."""
        if self.dp is None:
            return
        if isinstance(self.logprobs, torch.nn.parallel.DistributedDataParallel):
            self.logprobs = self.logprobs.module
        self.dp = None
        gc.collect()  # the reducer goes now, not at some later collection

    def padding_micro_step(self, marks: PhaseMarks | None = None) -> None:
        """Zero-loss forward + backward for a padding slot of a data-parallel step: this rank joins
        the gradient all-reduce, its gradient unchanged; adds three marks to ``marks``."""
        marks = marks if marks is not None else PhaseMarks(self._device())
        marks.mark()
        with self.precision.autocast(self._device()):
            lp, _entropy = self.logprobs(np.zeros(2, np.int64), np.array([2]))
        marks.mark()
        (lp.sum() * 0.0).backward()
        marks.mark()

    def _add_phase_times(self, marks: PhaseMarks, first: int) -> None:
        """Add the micro-batch whose marks start at ``first`` to the forward and backward seconds."""
        self.phase_s["forward"] += marks.seconds(first, first + 1)
        self.phase_s["backward"] += marks.seconds(first + 1, first + 2)

    def step(self, micro_batches: Sequence[MicroBatch | None]) -> dict[str, float]:
        """One optimizer step over a step's micro-batches (data-parallel: this rank's share, ``None``
        for padding slots); returns the whole step's metrics (keys:
        :data:`trainer.observability.step_keys.STEP_KEYS`). ValueError for no slots, several steps,
        padding without data parallelism, or no micro-batch on one rank."""
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
