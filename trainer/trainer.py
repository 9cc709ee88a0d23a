"""The trainer's logic: one optimizer step from a list of packed micro-batches.

Gradients are accumulated over the step's micro-batches; each micro-batch loss is already
normalized by the loss tokens of the whole step (``MicroBatch.step_loss_tokens``), so their sum
is the token-mean AIPO loss of the step (see :mod:`trainer.loss`). Then the gradient norm is
clipped and AdamW steps with a constant learning rate. No sockets here (see :mod:`trainer.proc`).

Non-finite guard: if any micro-batch loss or the gradient norm is NaN/inf, the optimizer step is
skipped: gradients are dropped, weights and AdamW state (moments, step count) stay bit-identical,
``rlbus_trainer_skipped_steps_total{reason}`` grows, and the metrics say ``skipped: 1.0``. The
caller still advances the policy version and broadcasts the (unchanged) weights: every step of
the pipeline then means one version, so the prompt source's gating, the packer's staleness check
and the producers stay in lockstep with no "step without a version" case to handle anywhere.
The micro-batches of a skipped step count as trained (they were consumed, not lost).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
from prometheus_client import Counter

from bus.messages import MicroBatch
from configs.schema import TrainerConfig
from trainer.loss import AipoLossConfig, aipo_loss
from trainer.packed import packed_token_logprobs

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
    """AdamW over the trainable parameters (all weights, or the LoRA adapter)."""
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


class Trainer:
    """Takes optimizer steps on the policy.

    Args:
        model: HF causal LM (possibly peft-wrapped), float32, in train mode.
        cfg: the trainer section of the run config.
        temperature: the sampler's temperature; logits are divided by it before log-softmax so
            the trainer's logprobs are the same quantity as the producers'.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, temperature: float) -> None:
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.optimizer = build_optimizer(model, cfg)
        lc = cfg.loss
        self.loss_cfg = AipoLossConfig(
            adv_tau=lc.adv_tau,
            kl_tau=lc.kl_tau,
            token_mask_low=lc.token_mask_low,
            token_mask_high=lc.token_mask_high,
            geo_mask_low=lc.geo_mask_low,
            geo_mask_high=lc.geo_mask_high,
        )

    def micro_step(self, mb: MicroBatch) -> tuple[float, dict[str, float]]:
        """Forward + backward of one micro-batch; returns its loss contribution and loss stats.

        Besides the loss stats, reports ``onpolicy_tokens`` and ``onpolicy_lp_diff_max``: the
        largest ``|lp_train - lp_infer|`` over loss tokens of samples generated under exactly
        the weights being trained (version == step). Those must agree up to numerics; a large
        value means the producers do not run the trainer's weights.
        """
        input_ids = torch.from_numpy(np.array(mb.input_ids, dtype=np.int64))
        seq_lens = torch.from_numpy(np.array(mb.seq_lens, dtype=np.int64))
        lp_infer = torch.from_numpy(np.array(mb.inference_logprobs))
        loss_mask = torch.from_numpy(np.array(mb.loss_mask))
        lp_train = packed_token_logprobs(self.model, input_ids, seq_lens, temperature=self.temperature)
        loss, stats = aipo_loss(
            lp_train,
            lp_infer,
            torch.from_numpy(np.array(mb.advantages)),
            loss_mask,
            seq_lens,
            mb.step_loss_tokens,
            self.loss_cfg,
        )
        loss.backward()
        token_version = torch.from_numpy(np.array(mb.versions)).repeat_interleave(seq_lens)
        on_policy = loss_mask & (token_version == mb.step)
        diff = (lp_train.detach() - lp_infer)[on_policy].abs()
        stats["onpolicy_tokens"] = float(on_policy.sum())
        stats["onpolicy_lp_diff_max"] = float(diff.max()) if len(diff) else 0.0
        return float(loss.detach()), stats

    def step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """One optimizer step over all micro-batches of a step.

        Returns:
            Step metrics: ``loss``, ``kl`` (mean k3 estimate, nats), ``masked_frac``,
            ``importance_ratio_mean/min/max``, ``grad_norm`` (before clipping), ``num_tokens``,
            ``num_loss_tokens``, ``num_samples``, ``num_micro_batches``, ``reward_mean``,
            ``reward_std``, ``onpolicy_tokens``, ``onpolicy_lp_diff_max`` (see :meth:`micro_step`),
            ``train_time_s``, ``skipped`` (1.0 if the non-finite guard skipped the optimizer
            step, else 0.0; see the module docstring). On a skipped step ``loss`` and
            ``grad_norm`` may be NaN/inf.

        Raises:
            ValueError: ``micro_batches`` is empty or mixes steps.
        """
        if not micro_batches or len({mb.step for mb in micro_batches}) != 1:
            raise ValueError("a step needs its micro-batches, all of one step")
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        finite_losses = True
        totals: dict[str, float] = {"loss_tokens": 0.0, "masked_tokens": 0.0, "kl_sum": 0.0, "ratio_sum": 0.0}
        ratio_min, ratio_max = math.inf, -math.inf
        onpolicy_tokens, onpolicy_diff = 0.0, 0.0
        for mb in micro_batches:
            mb_loss, stats = self.micro_step(mb)
            loss += mb_loss
            finite_losses &= math.isfinite(mb_loss)
            for key in totals:
                totals[key] += stats[key]
            onpolicy_tokens += stats["onpolicy_tokens"]
            onpolicy_diff = max(onpolicy_diff, stats["onpolicy_lp_diff_max"])
            ratio_min = min(ratio_min, stats["ratio_min"])
            ratio_max = max(ratio_max, stats["ratio_max"])
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm))
        reason = None if finite_losses else "non_finite_loss"
        if reason is None and not math.isfinite(grad_norm):
            reason = "non_finite_grad"
        if reason is None:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            SKIPPED_STEPS.labels(reason=reason).inc()
            log.warning(
                "step %d: skipped the optimizer step (%s: loss %s, grad norm %s); weights unchanged",
                micro_batches[0].step, reason, loss, grad_norm,
            )
        n_loss = max(totals["loss_tokens"], 1.0)
        rewards = np.concatenate([mb.rewards for mb in micro_batches])
        return {
            "loss": loss,
            "kl": totals["kl_sum"] / n_loss,
            "masked_frac": totals["masked_tokens"] / n_loss,
            "importance_ratio_mean": totals["ratio_sum"] / n_loss,
            "importance_ratio_min": ratio_min,
            "importance_ratio_max": ratio_max,
            "grad_norm": grad_norm,
            "num_tokens": float(sum(len(mb.input_ids) for mb in micro_batches)),
            "num_loss_tokens": totals["loss_tokens"],
            "num_samples": float(len(rewards)),
            "num_micro_batches": float(len(micro_batches)),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "onpolicy_tokens": onpolicy_tokens,
            "onpolicy_lp_diff_max": onpolicy_diff,
            "train_time_s": time.perf_counter() - started,
            "skipped": 0.0 if reason is None else 1.0,
        }
