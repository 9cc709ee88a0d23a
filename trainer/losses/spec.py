"""What a policy loss is asked to compute: the loss choice (`LossSpec`), the step normalizers
(`StepNorm`) and one micro-batch's packed inputs (`LossBatch`).

All three validate themselves on construction, so `policy_loss` can trust them: a bad value raises
`ValueError` naming the field, the value and the fix. `LossSpec` mirrors `configs.schema.LossConfig`
field for field (same names, defaults and bounds), so `LossSpec.from_config(cfg)` is the whole
integration. This module imports torch only for the tensor checks of `LossBatch`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "KL_REFERENCES",
    "LOSS_TYPES",
    "RATIO_TYPES",
    "LossBatch",
    "LossSpec",
    "StepNorm",
]

LOSS_TYPES = ("aipo", "ppo_clip", "importance_sampling", "gspo")
RATIO_TYPES = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REFERENCES = ("rollout", "reference")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _finite_at_least(name: str, value: float, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class LossSpec:
    """Which policy loss, with which options (all dimensionless). Mirrors `configs.schema.LossConfig`.

    Ratios: `pi_x` is the probability of a sampled token under policy x; `rollout` is the
    inference engine that sampled it, `train` the trainer's current weights, `old` the weights at
    the start of the optimizer step (see `LossBatch.old_logprobs`).

    Attributes:
        type: "aipo" (default; prime-rl's masked importance-weighted policy gradient),
            "ppo_clip" (PPO clipped surrogate, optional dual clip), "importance_sampling"
            (-(r * A), no clipping) or "gspo" (sequence-level geometric-mean ratio, clipped).
        adv_tau: weight of the advantage, >= 0 (every type).
        ratio_type: aipo only: "token" weights token t by its own ratio; "sequence" weights every
            token of a sample by the product of the sample's token ratios, clipped above at
            sequence_clip_high (prime-rl).
        token_mask_low, token_mask_high: aipo only: a loss token whose mismatch ratio
            pi_train/pi_rollout lies outside [low, high] gets zero gradient; 0 <= low <= 1 <= high.
        geo_mask_low, geo_mask_high: aipo only: a sample whose geometric-mean mismatch ratio lies
            outside [low, high] gets zero gradient on all its tokens; 0 <= low <= 1 <= high.
        sequence_mask_low, sequence_mask_high: aipo only, None = off: a sample whose smallest
            token ratio is below low (largest above high) gets zero gradient; low in [0, 1],
            high >= 1.
        sequence_clip_high: aipo with ratio_type "sequence": upper clip of the sample ratio, >= 1.
        eps_clip: ppo_clip and gspo: lower clip 1 - eps_clip of the ratio, 0 < eps_clip < 1.
        eps_clip_high: ppo_clip and gspo: upper clip 1 + eps_clip_high, > 0; None = eps_clip.
        eps_clip_c: ppo_clip only, None = off: dual clip, the loss of a token with negative
            advantage is at most -A * eps_clip_c; must be > 1.
        icepop_beta: any type, None = off: a loss token whose mismatch ratio lies outside
            [1/beta, beta] gets zero gradient (IcePop); must be > 1.
        use_tis: any type: truncated importance sampling. Needs `LossBatch.old_logprobs`; the policy
            ratio becomes pi_train/pi_old and every token's loss is weighted by
            clip(pi_old/pi_rollout, tis_clip_low, tis_clip_high) (detached).
        tis_clip_low, tis_clip_high: the TIS weight bounds, 0 <= low <= 1 <= high, low < high.
        kl_tau: any type: weight of the KL penalty added to each kept token's loss, >= 0 (0 = off).
        kl_estimator: "k1" | "k2" | "k3" (Schulman), estimating KL(pi_train || pi_ref).
        kl_reference: "rollout" (pi_ref = the sampler) or "reference" (a frozen reference model;
            needs `LossBatch.ref_logprobs`).
        teacher_tau: any type: on-policy distillation, the advantage of token t becomes
            adv_tau * A_t + teacher_tau * (lp_teacher_t - lp_train_t) (detached); needs
            `LossBatch.teacher_logprobs` when > 0.
        aggregation: "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum_norm" (see
            `trainer.losses.aggregation`).

    Raises:
        ValueError: an unknown choice, a bound out of range, or an option that belongs to another
            type (ratio_type "sequence", sequence_mask_* or eps_clip_c with a type that ignores it).
    """

    type: Literal["aipo", "ppo_clip", "importance_sampling", "gspo"] = "aipo"
    adv_tau: float = 1.0
    ratio_type: Literal["token", "sequence"] = "token"
    token_mask_low: float = 0.125
    token_mask_high: float = 8.0
    geo_mask_low: float = 0.1
    geo_mask_high: float = 10.0
    sequence_mask_low: float | None = None
    sequence_mask_high: float | None = None
    sequence_clip_high: float = 10.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    icepop_beta: float | None = None
    use_tis: bool = False
    tis_clip_low: float = 0.0
    tis_clip_high: float = 2.0
    kl_tau: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_reference: Literal["rollout", "reference"] = "rollout"
    teacher_tau: float = 0.0
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"

    def __post_init__(self) -> None:
        _one_of("type", self.type, LOSS_TYPES)
        _one_of("ratio_type", self.ratio_type, RATIO_TYPES)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("kl_reference", self.kl_reference, KL_REFERENCES)
        _one_of("aggregation", self.aggregation, AGGREGATIONS)
        for name in ("adv_tau", "kl_tau", "teacher_tau"):
            _finite_at_least(name, getattr(self, name), 0.0)
        for prefix in ("token_mask", "geo_mask"):
            low, high = getattr(self, f"{prefix}_low"), getattr(self, f"{prefix}_high")
            if not (0 <= low <= 1 <= high) or math.isnan(high):
                raise ValueError(
                    f"{prefix}_low/{prefix}_high must satisfy 0 <= low <= 1 <= high (an on-policy ratio of 1 "
                    f"must be kept), got low={low!r}, high={high!r}"
                )
        if self.sequence_mask_low is not None and not 0 <= self.sequence_mask_low <= 1:
            raise ValueError(f"sequence_mask_low must be in [0, 1] or None (off), got {self.sequence_mask_low!r}")
        if self.sequence_mask_high is not None and not (1 <= self.sequence_mask_high < math.inf):
            raise ValueError(
                f"sequence_mask_high must be a finite number >= 1 or None (off), got {self.sequence_mask_high!r}"
            )
        _finite_at_least("sequence_clip_high", self.sequence_clip_high, 1.0)
        if not 0 < self.eps_clip < 1:
            raise ValueError(
                f"eps_clip must be in (0, 1) so the lower clip 1 - eps_clip is positive, got {self.eps_clip!r}"
            )
        if self.eps_clip_high is not None and not 0 < self.eps_clip_high < math.inf:
            raise ValueError(
                f"eps_clip_high must be a finite number > 0 or None (= eps_clip), got {self.eps_clip_high!r}"
            )
        if self.eps_clip_c is not None and not 1 < self.eps_clip_c < math.inf:
            raise ValueError(
                f"eps_clip_c (dual clip) must be a finite number > 1 or None (off), got {self.eps_clip_c!r}"
            )
        if self.icepop_beta is not None and not 1 < self.icepop_beta < math.inf:
            raise ValueError(f"icepop_beta must be a finite number > 1 or None (off), got {self.icepop_beta!r}")
        if not isinstance(self.use_tis, bool):
            raise ValueError(f"use_tis must be a bool, got {self.use_tis!r}")
        low, high = self.tis_clip_low, self.tis_clip_high
        if not (0 <= low <= 1 <= high < math.inf and low < high):
            raise ValueError(
                f"tis_clip_low/tis_clip_high must satisfy 0 <= low <= 1 <= high < inf and low < high, "
                f"got low={low!r}, high={high!r}"
            )
        self._check_type_specific()

    def _check_type_specific(self) -> None:
        """Options that only one type reads must not be set with another (they would be ignored)."""
        if self.type != "aipo":
            if self.ratio_type != "token":
                raise ValueError(
                    f"ratio_type='sequence' is an aipo option; type={self.type!r} ignores it: set type='aipo' or ratio_type='token'"
                )
            for name in ("sequence_mask_low", "sequence_mask_high"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} is an aipo option; type={self.type!r} ignores it: leave it None (use icepop_beta)"
                    )
        if self.type != "ppo_clip" and self.eps_clip_c is not None:
            raise ValueError(
                f"eps_clip_c (dual clip) is a ppo_clip option; type={self.type!r} ignores it: leave it None"
            )

    @property
    def clip_high(self) -> float:
        """eps_clip_high, or eps_clip when it is None (symmetric clip)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @classmethod
    def from_config(cls, cfg: Any) -> "LossSpec":
        """Build from `configs.schema.LossConfig` (or anything with `model_dump()` giving these fields).

        Raises:
            ValueError: the config has a field LossSpec lacks, or a value LossSpec rejects.
        """
        values = dict(cfg.model_dump())
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"LossConfig fields {sorted(unknown)} have no LossSpec counterpart; update trainer/losses/spec.py"
            )
        return cls(**values)


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ValueError(f"StepNorm.{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)  # numpy ints accepted
    if value < low:
        raise ValueError(f"StepNorm.{name} must be >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class StepNorm:
    """Normalizers of the WHOLE optimizer step (every micro-batch on every rank), not of one micro-batch.

    Dividing each micro-batch's loss by step-wide counts makes the sum of the micro-batch losses
    (and the sum of their gradients over ranks) exactly the loss of the step computed at once,
    however the step was split, as long as no sample is split across micro-batches.

    Attributes:
        loss_tokens: loss tokens of the step (loss_mask True), >= 0; masked tokens count too.
        num_samples: samples of the step with >= 1 loss token, >= 0.
        max_tokens: Dr. GRPO's constant length normalizer (the sampler's max completion tokens), >= 1.

    numpy integers are accepted and stored as int.

    Raises:
        ValueError: a count is not an int or is out of range.
    """

    loss_tokens: int
    num_samples: int
    max_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_tokens", _count("loss_tokens", self.loss_tokens, 0))
        object.__setattr__(self, "num_samples", _count("num_samples", self.num_samples, 0))
        object.__setattr__(self, "max_tokens", _count("max_tokens", self.max_tokens, 1))


@dataclass(frozen=True)
class LossBatch:
    """One packed micro-batch as the loss sees it: flat `[T]` tensors split into samples by `seq_lens`.

    Attributes:
        train_logprobs: `[T]` float, log pi_train(y_t | y_<t) from the trainer's forward, requires grad; nats.
        sampler_logprobs: `[T]` float, the sampler's logprob of each token; nats; finite on loss tokens.
        advantages: `[T]` float, the sample's advantage on each of its tokens; finite on loss tokens.
        loss_mask: `[T]` bool, True on the tokens that carry loss (completion tokens).
        seq_lens: `[S]` int, sample lengths >= 1 summing to T, in packing order.
        old_logprobs: `[T]` float or None, log pi_old: the trainer's logprobs under the weights the step
            started from (rlbus takes one optimizer step per batch, so `train_logprobs.detach()`); read
            only when `LossSpec.use_tis`; finite on loss tokens.
        ref_logprobs: `[T]` float or None, a frozen reference model's logprobs; read only when kl_tau > 0
            and kl_reference == "reference"; finite on loss tokens.
        teacher_logprobs: `[T]` float or None, a teacher model's logprobs (on-policy distillation); read
            when teacher_tau > 0 (required then) and for the `teacher_kl_sum` stat; finite on loss tokens.
        entropy: `[T]` float or None, entropy of the trainer's next-token distribution (nats,
            detached), for the `entropy_sum` stat only.
        checked: True when the caller has already checked on the host every value check that
            would read the device (seq_lens, the step norm, finite inputs:
            `trainer.losses.checks.check_loss_inputs`); then neither this class nor
            `policy_loss_terms` reads a device value back (no host sync). Default False: checked here.
    All tensors, seq_lens included, must be on one device.

    Raises:
        ValueError: a tensor has the wrong shape/kind/device, or seq_lens do not split T.
    """

    train_logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    checked: bool = False

    def __post_init__(self) -> None:
        lp = self.train_logprobs
        if not isinstance(lp, torch.Tensor) or lp.ndim != 1 or not lp.dtype.is_floating_point:
            raise ValueError("train_logprobs must be a 1-D float tensor [num_tokens] (flat packed logprobs)")
        num_tokens = lp.shape[0]
        named = {"sampler_logprobs": self.sampler_logprobs, "advantages": self.advantages, "loss_mask": self.loss_mask}
        named.update(
            {
                k: getattr(self, k)
                for k in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "entropy")
                if getattr(self, k) is not None
            }
        )
        for name, tensor in named.items():
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (num_tokens,):
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name} must be a tensor of shape [{num_tokens}] like train_logprobs, got {shape}")
            if name != "loss_mask" and not tensor.dtype.is_floating_point:
                raise ValueError(f"{name} must be a float tensor, got {tensor.dtype}; use .float()")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be a bool tensor, got {self.loss_mask.dtype}; use .bool()")
        lens = self.seq_lens
        devices = {str(t.device) for t in (*named.values(), lens) if isinstance(t, torch.Tensor)} | {str(lp.device)}
        if len(devices) > 1:
            raise ValueError(
                f"LossBatch tensors must all be on one device, got {sorted(devices)}; move them with .to(device)"
            )
        if not isinstance(lens, torch.Tensor) or lens.ndim != 1 or lens.numel() == 0:
            raise ValueError("seq_lens must be a non-empty 1-D tensor [num_samples] of sample lengths")
        if lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.is_complex():
            raise ValueError(f"seq_lens must be an integer tensor, got {lens.dtype}; use .long()")
        if self.checked:  # the values were checked on the host (trainer.losses.checks): no device read here
            return
        if bool((lens < 1).any()):
            raise ValueError(f"seq_lens must all be >= 1, got {lens.tolist()}; drop empty samples before packing")
        if int(lens.sum()) != num_tokens:
            raise ValueError(f"seq_lens must sum to the packed length {num_tokens}, got sum {int(lens.sum())}")

    @property
    def num_tokens(self) -> int:
        """T, the packed length."""
        return int(self.train_logprobs.shape[0])
