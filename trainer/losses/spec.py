"""What a policy loss computes: the choice (`LossSpec`), the step normalizers (`StepNorm`) and one
micro-batch's inputs (`LossBatch`). Each validates itself (ValueError naming field, value and fix).
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
    """Which policy loss, with which options: field for field `configs.training.LossConfig`, whose field
    descriptions give each meaning and bound.

    Raises:
        ValueError: an unknown choice, a bound out of range, or an option of another type (ratio_type
            "sequence", sequence_mask_* or eps_clip_c with a type that ignores it).
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
        """Options only one type reads must not be set with another."""
        if self.type != "aipo":
            if self.ratio_type != "token":
                raise ValueError(
                    f"ratio_type='sequence' is an aipo option; type={self.type!r} ignores it: "
                    "set type='aipo' or ratio_type='token'"
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
        """From a `LossConfig` (anything whose `model_dump()` gives these fields); ValueError for a field
        LossSpec lacks or a value it rejects.
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
    """Normalizers of the whole optimizer step (every micro-batch and rank), so micro-batch losses sum to
    the step's however it is split (no sample split): `loss_tokens` (masked included) and `num_samples`
    (with a loss token) >= 0, `max_tokens` (Dr. GRPO's constant) >= 1; ValueError otherwise.
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
    """One packed micro-batch as the loss sees it: `[T]` tensors on one device, split by `seq_lens` `[S]`.

    `train_logprobs` (requires grad), `sampler_logprobs`, `advantages`: float, nats; `loss_mask`: bool.
    Optional: `old_logprobs` (pi_old = `train_logprobs.detach()`, one step per batch; for use_tis),
    `ref_logprobs`, `teacher_logprobs`, `entropy`. Inputs read must be finite on loss tokens.
    `checked`: `trainer.losses.checks.check_loss_inputs` already ran on the host (no device reads here).
    ValueError for a tensor of the wrong shape, kind or device, or seq_lens not splitting T.
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
