"""The trainer's logic: one optimizer step from a list of packed micro-batches.

Gradients are accumulated over the step's micro-batches; each micro-batch loss is already
normalized by step-wide totals (``MicroBatch.step_loss_tokens`` and ``step_samples``), so their
sum is the step's loss under the configured aggregation whatever the split into micro-batches
and data-parallel ranks (see :mod:`trainer.losses`; tested in float64 by
``tests/trainer/test_invariance.py``). Then the gradient norm is clipped and AdamW steps with the
learning rate of ``trainer.optim``'s schedule (:mod:`trainer.optim.lr_schedule`; the scheduler steps
after every step, skipped ones too, so step ``s`` always trains with the schedule's rate at ``s``).
No sockets here (see :mod:`trainer.proc`).

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
from collections.abc import Callable, Sequence

import numpy as np
import torch
from prometheus_client import Counter

from bus.messages import MicroBatch
from configs.schema import RunConfig, TrainerConfig
from trainer.losses import LossBatch, LossSpec, StepNorm, policy_loss
from trainer.parallel.distributed import DataParallel
from trainer.observability.lag_stats import lag_fractions, lag_token_counts
from trainer.forward.packed import PackedLogprobs
from trainer.forward.precision import PrecisionPolicy
from trainer.forward.reference import ReferencePolicy
from trainer.optim.lr_schedule import build_lr_scheduler, rebind_lr_scheduler
from trainer.parallel.sharding import clip_grad_norm, enable_activation_checkpointing, shard_keeping_optimizer_state
from trainer.observability.step_timing import device_clock, phase_key

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
            if needs_reference else None
        )
        """The frozen start policy of the KL penalty, built before any step (None: not used)."""
        self.precision = PrecisionPolicy.from_name(cfg.dtype)
        """The compute dtype of the policy's and the reference's forwards (``trainer.dtype``,
        :mod:`trainer.forward.precision`): parameters, gradients and AdamW state stay float32."""
        self.phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        """Seconds of the current (or last) :meth:`step` per phase (:mod:`trainer.observability.step_timing`)."""

    def micro_step(self, mb: MicroBatch) -> tuple[float, dict[str, float]]:
        """Forward + backward of one micro-batch; returns its loss contribution and loss stats.

        The loss is :func:`trainer.loss.policy_loss` with the step-wide normalizers the packer
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
        off-policy lag (:func:`trainer.observability.lag_stats.lag_token_counts`).
        """
        device = next(self.model.parameters()).device
        started = device_clock(device)

        def tensor(array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.from_numpy(np.array(array)).to(device=device, dtype=dtype)

        input_ids = tensor(mb.input_ids, torch.int64)
        seq_lens = tensor(mb.seq_lens, torch.int64)
        loss_mask = tensor(mb.loss_mask)
        self.set_temperature(mb.temperature)
        with self.precision.autocast(device):  # the forwards only; the loss below is float32
            # only the loss tokens: the loss, its statistics and the on-policy check read nothing else
            train_logprobs, entropy = self.logprobs(input_ids, seq_lens, loss_mask)
            ref_logprobs = self.reference.logprobs(input_ids, seq_lens, mb.temperature, loss_mask) if self.reference else None
        sampler_logprobs = tensor(mb.sampler_logprobs, train_logprobs.dtype)
        spec = self.loss_spec
        batch = LossBatch(
            train_logprobs=train_logprobs,
            sampler_logprobs=sampler_logprobs,
            advantages=tensor(mb.advantages, train_logprobs.dtype),
            loss_mask=loss_mask,
            seq_lens=seq_lens,
            old_logprobs=train_logprobs.detach() if spec.use_tis else None,
            ref_logprobs=ref_logprobs.to(train_logprobs.dtype) if ref_logprobs is not None else None,
            teacher_logprobs=tensor(mb.teacher_logprobs, train_logprobs.dtype) if len(mb.teacher_logprobs) else None,
            entropy=entropy.to(train_logprobs.dtype),
        )
        norm = StepNorm(loss_tokens=mb.step_loss_tokens, num_samples=mb.step_samples, max_tokens=self.max_tokens)
        loss, stats = policy_loss(batch, norm, spec)
        forwarded = device_clock(device)
        loss.backward()
        self._add_phase_times(started, forwarded, device_clock(device))
        token_version = tensor(mb.token_versions, torch.int64)
        on_policy = loss_mask & (token_version == mb.step)
        diff = (train_logprobs.detach() - sampler_logprobs)[on_policy].abs()
        stats["onpolicy_tokens"] = float(on_policy.sum())
        stats["onpolicy_lp_diff_max"] = float(diff.max()) if len(diff) else 0.0
        stats.update(lag_token_counts(token_version, loss_mask, mb.step))
        stats["decoder_tokens"] = self._packed().stats["decoder_tokens"]
        return float(loss.detach()), stats

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
                self.logprobs, self.optimizer, build, dp.device, dp.world_size, bfloat16=self.cfg.dtype == "bfloat16",
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

    def padding_micro_step(self) -> None:
        """Forward + backward with zero loss, for a padding slot of a data-parallel step.

        Every trainable parameter gets a zero gradient through the same DDP module, so this rank
        runs as many forwards and backwards as the others and joins the gradient all-reduce; its
        accumulated gradient is unchanged (``0 * logprobs``; a non-finite forward would still
        poison it, and then the step is skipped on every rank anyway).
        """
        device = next(self.model.parameters()).device
        started = device_clock(device)
        input_ids = torch.zeros(2, dtype=torch.int64, device=device)
        seq_lens = torch.tensor([2], dtype=torch.int64, device=device)
        with self.precision.autocast(device):
            lp, _entropy = self.logprobs(input_ids, seq_lens)
        forwarded = device_clock(device)
        (lp.sum() * 0.0).backward()
        self._add_phase_times(started, forwarded, device_clock(device))

    def _add_phase_times(self, started: float, forwarded: float, backwarded: float) -> None:
        """Charge one micro-batch's forward (``started`` -> ``forwarded``) and backward
        (-> ``backwarded``), ``perf_counter`` seconds, to the step's phase times."""
        self.phase_s["forward"] += forwarded - started
        self.phase_s["backward"] += backwarded - forwarded

    def step(self, micro_batches: Sequence[MicroBatch | None]) -> dict[str, float]:
        """One optimizer step over all micro-batches of a step (with data parallelism: this
        rank's share of them, padded with ``None`` slots; see :mod:`trainer.parallel.distributed`).

        Gradients of the micro-batches accumulate (under DDP ``no_sync`` but for the last slot,
        whose backward all-reduces them). The micro-batch stats are merged with
        :func:`merge_stats` over micro-batches and then over ranks, so every rank's metrics cover
        the whole step. The gradient norm is clipped on the synchronized gradient (the same on
        every rank), and whether the non-finite guard skips the step is decided on the merged
        stats, so every rank skips or steps alike.

        Returns:
            Step metrics: ``loss``, ``kl`` (mean k3 estimate, nats), ``masked_frac``,
            ``importance_ratio_mean/min/max``, ``clipfrac`` (loss tokens whose gradient a clip
            removed), ``entropy`` (mean entropy of the tempered policy, nats), and when their
            option is on ``kl_penalty`` (mean penalty estimator, nats), ``teacher_kl`` (mean
            train_logprobs - teacher_logprobs, nats), ``tis_clipfrac``; ``grad_norm`` (before clipping), ``num_tokens``,
            ``num_loss_tokens``, ``num_samples``, ``num_micro_batches``, ``reward_mean``,
            ``reward_std``, ``reward/<name>`` (each reward function's mean score), ``lr`` (the learning
            rate of this step's update), ``onpolicy_tokens``, ``onpolicy_lp_diff_max`` (see :meth:`micro_step`),
            ``lag_frac/<bucket>`` (fraction of loss tokens per off-policy lag, :mod:`trainer.observability.lag_stats`),
            ``train_time_s`` (this rank's), ``time/forward_s``, ``time/backward_s`` (sums over
            micro-batches) and ``time/optimizer_s`` (clip, stats all-gather, AdamW) of this rank,
            seconds (:mod:`trainer.observability.step_timing`), ``skipped`` (1.0 if the non-finite guard skipped the
            optimizer step, else 0.0; see the module docstring), ``decoder_tokens`` (tokens the
            decoder ran: ``num_tokens`` less the shared prefixes, :mod:`trainer.forward.shared_prefix`), and
            every other micro-batch stat as its step total (sum, or min/max for ``*_min``/``*_max``). On a skipped step
            ``loss`` and ``grad_norm`` may be NaN/inf.

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
        totals: dict[str, float] = {}
        last = len(micro_batches) - 1
        for k, mb in enumerate(micro_batches):
            if self.before_micro_batch is not None:
                self.before_micro_batch()
            with DataParallel.grad_sync(self.logprobs, sync=k == last):
                if mb is None:
                    self.padding_micro_step()
                    continue
                mb_loss, stats = self.micro_step(mb)
            rewards = np.asarray(mb.rewards, dtype=np.float64)
            stats.update(
                loss=mb_loss,
                non_finite_losses=float(not math.isfinite(mb_loss)),
                num_tokens=float(len(mb.input_ids)),
                num_micro_batches=1.0,
                num_samples=float(len(rewards)),
                reward_sum=float(rewards.sum()),
                reward_sq_sum=float((rewards**2).sum()),
                **reward_term_stats(mb.reward_terms),
            )
            totals = merge_stats(totals, stats)
        params = [p for p in self.model.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        optimizing = device_clock(device)
        grad_norm = clip_grad_norm(params, self.cfg.optim.max_grad_norm)  # over the shards with fsdp
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
                real[0].step if real else "?", reason, totals.get("loss"), grad_norm,
            )
        self.scheduler.step()  # skipped steps too: the rate is a function of the step (module docstring)
        self.phase_s["optimizer"] = device_clock(device) - optimizing
        metrics = step_metrics(totals, grad_norm, time.perf_counter() - started, skipped=reason is not None)
        metrics["lr"] = lr
        metrics.update({phase_key(phase): seconds for phase, seconds in self.phase_s.items()})  # this rank's
        return metrics


REWARD_TERM_PREFIX = "reward_terms/"
"""Stats keys ``reward_terms/<name>/sum`` and ``/count`` (not ending in ``_min``/``_max``, so
:func:`merge_stats` sums them whatever the reward function's name)."""


def reward_term_stats(reward_terms: dict[str, list[float]]) -> dict[str, float]:
    """Per-function sums and counts of one micro-batch's ``reward_terms`` ({name: [S] scores})."""
    stats = {}
    for name, scores in reward_terms.items():
        stats[f"{REWARD_TERM_PREFIX}{name}/sum"] = float(np.sum(np.asarray(scores, np.float64)))
        stats[f"{REWARD_TERM_PREFIX}{name}/count"] = float(len(scores))
    return stats


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Merge two sets of micro-batch (or rank) stats: keys ending in ``_min`` take the minimum,
    ``_max`` the maximum, every other key is a sum (the loss stats contract: sums, min, max per
    micro-batch). A key missing on one side takes the other side's value. Returns a new dict."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key.endswith("_min"):
            out[key] = min(out[key], value)
        elif key.endswith("_max"):
            out[key] = max(out[key], value)
        else:
            out[key] = out[key] + value
    return out


def step_metrics(totals: dict[str, float], grad_norm: float, train_time_s: float, *, skipped: bool) -> dict[str, float]:
    """The metrics of :meth:`Trainer.step` from the step's merged stats (see its docstring).

    Per-token means divide by the step's loss tokens (at least 1). Rewards: ``mean = S1 / n``,
    ``std = sqrt(max(S2 / n - mean**2, 0))`` from float64 sums over micro-batches and ranks (the
    clamp absorbs rounding; for rewards of order 1 the one-pass error is ~1e-16, negligible for a
    metric); NaN when the step has no samples. ``reward/<name>`` = the mean of reward function
    ``name``'s own score over the step's samples that carry it (``MicroBatch.reward_terms``).
    """
    t = dict(totals)
    n_loss = max(t.get("loss_tokens", 0.0), 1.0)
    n = t.pop("num_samples", 0.0)
    s1, s2 = t.pop("reward_sum", 0.0), t.pop("reward_sq_sum", 0.0)
    reward_mean = s1 / n if n else math.nan
    reward_std = math.sqrt(max(s2 / n - reward_mean**2, 0.0)) if n else math.nan
    metrics = {
        "loss": t.pop("loss", 0.0),
        "kl": t.pop("kl_sum", 0.0) / n_loss,
        "masked_frac": t.pop("masked_tokens", 0.0) / n_loss,
        "importance_ratio_mean": t.pop("ratio_sum", 0.0) / n_loss,
        "importance_ratio_min": t.pop("ratio_min", math.inf),
        "importance_ratio_max": t.pop("ratio_max", -math.inf),
        "clipfrac": t.pop("clipped_tokens", 0.0) / n_loss,
        "entropy": t.pop("entropy_sum", 0.0) / n_loss,
        "grad_norm": grad_norm,
        "num_tokens": t.pop("num_tokens", 0.0),
        "num_loss_tokens": t.pop("loss_tokens", 0.0),
        "num_samples": n,
        "num_micro_batches": t.pop("num_micro_batches", 0.0),
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "onpolicy_tokens": t.pop("onpolicy_tokens", 0.0),
        "onpolicy_lp_diff_max": t.pop("onpolicy_lp_diff_max", 0.0),
        "train_time_s": train_time_s,
        "skipped": 1.0 if skipped else 0.0,
        **lag_fractions(t),
    }
    for key, total in (("kl_penalty", "kl_penalty_sum"), ("teacher_kl", "teacher_kl_sum"), ("tis_clipfrac", "tis_clipped_tokens")):
        if total in t:  # reported only when the option is on
            metrics[key] = t.pop(total) / n_loss
    for key in sorted(k for k in t if k.startswith(REWARD_TERM_PREFIX) and k.endswith("/sum")):
        name = key[len(REWARD_TERM_PREFIX) : -len("/sum")]
        count = t.pop(f"{REWARD_TERM_PREFIX}{name}/count", 0.0)
        metrics[f"reward/{name}"] = t.pop(key) / count if count else math.nan
    t.pop("non_finite_losses", None)
    t.pop("non_finite_grad_max", None)
    for key, value in t.items():  # further loss stats, as step totals
        metrics.setdefault(key, value)
    return metrics
