"""The default GRPO loss of rlbus: a token-level, importance-weighted (AIPO-style) policy gradient.

Samples are drawn by the inference engine's policy `pi_infer` (possibly several optimizer steps old,
and numerically different from the trainer even at the same version); the trainer's policy is
`pi_train`. Per token t, with `ratio_t = pi_train(y_t) / pi_infer(y_t)`:

    coeff_t = stop_grad( ratio_t * (adv_tau * A_t - kl_tau * log ratio_t) )
    loss    = - sum_t keep_t * coeff_t * log pi_train(y_t) / num_loss_tokens

so `d loss / d lp_train[t] = -keep_t * coeff_t / num_loss_tokens` exactly. The adv term is the
importance-weighted policy gradient E_{y~pi_infer}[ratio * A * grad log pi_train] (an unbiased
off-policy estimate of the on-policy gradient); the kl term adds the gradient of
`kl_tau * KL(pi_train || pi_infer)` to the minimized loss (up to a zero-mean term, since
grad KL = E_{pi_infer}[ratio * (log ratio + 1) * grad log pi_train]), so it pulls pi_train back
towards the sampler.

Sources and what we rely on:
- AIPO, "Asynchronous Importance weighted Policy Optimization", introduced in LlamaRL (Wu et al.
  2025, arXiv:2505.24034): train on rollouts from a lagging policy by weighting each token's
  policy gradient with the importance ratio pi_train / pi_infer computed against the *inference*
  logprobs, not a trainer-side "old" forward. We rely only on this importance-weighted gradient,
  not on AIPO's truncation rule or its entropy/KL terms.
- The token-level form, the coefficient with `adv_tau`/`kl_tau`, and the masks (token ratio outside
  [0.125, 8], sample geometric-mean ratio outside [0.1, 10]; masking rather than clipping, so an
  outlier contributes no gradient at all) follow prime-rl's loss (`trainer.loss` config, late
  2025; the INTELLECT-2 line of async RL, https://docs.primeintellect.ai/prime-rl/async).
- k3 KL estimator: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.

Invariants:
- All inputs are flat packed tensors `[T]`; `seq_lens [S]` sums to T and splits them into samples.
- Masked tokens (outside `loss_mask`, or removed by either mask) get exactly zero gradient, even if
  their ratio is inf or NaN.
- Stats are SUMS (and min/max) over this micro-batch's loss tokens, so a caller adds them over the
  micro-batches of a step and divides by the step's loss tokens.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from trainer.packed import validated_seq_lens

__all__ = ["AipoLossConfig", "aipo_loss", "k3_kl", "keep_mask", "sample_ids"]


@dataclass(frozen=True)
class AipoLossConfig:
    """Coefficients and mask bounds of `aipo_loss` (dimensionless).

    Attributes:
        adv_tau: weight of the advantage term, >= 0.
        kl_tau: weight of the KL(pi_train || pi_infer) pull term, >= 0 (0 disables it).
        token_mask_low, token_mask_high: a loss token is kept only if its ratio
            pi_train/pi_infer lies in [low, high] (inclusive); need 0 <= low <= 1 <= high.
        geo_mask_low, geo_mask_high: a sample is kept only if the geometric mean of its loss
            tokens' ratios, exp(mean log ratio), lies in [low, high]; need 0 <= low <= 1 <= high.

    Raises:
        ValueError: a coefficient is negative or not finite, or a bound pair does not contain 1.
    """

    adv_tau: float = 1.0
    kl_tau: float = 0.0
    token_mask_low: float = 0.125
    token_mask_high: float = 8.0
    geo_mask_low: float = 0.1
    geo_mask_high: float = 10.0

    def __post_init__(self) -> None:
        for name in ("adv_tau", "kl_tau"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for prefix in ("token_mask", "geo_mask"):
            low, high = getattr(self, f"{prefix}_low"), getattr(self, f"{prefix}_high")
            if not (0 <= low <= 1 <= high) or math.isnan(high):
                raise ValueError(
                    f"{prefix}_low/{prefix}_high must satisfy 0 <= low <= 1 <= high (an on-policy "
                    f"ratio of 1 must be kept), got low={low!r}, high={high!r}"
                )


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_infer || pi_train) from tokens sampled by pi_infer.

    Formula (Schulman, http://joschu.net/blog/kl-approx.html): for x ~ q and r = p(x)/q(x),
    k3 = (r - 1) - log r is an unbiased, non-negative estimator of KL(q || p). Here q = pi_infer
    (the sampler) and p = pi_train, so r = ratio = exp(log_ratio) and k3 estimates
    KL(pi_infer || pi_train).

    Args:
        log_ratio: `[T]` float, log pi_train(y_t) - log pi_infer(y_t) (nats).

    Returns:
        `[T]` same dtype, >= 0 (nats), 0 where log_ratio == 0.
    """
    return torch.expm1(log_ratio) - log_ratio


def sample_ids(seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of the packed sample each token belongs to.

    Args:
        seq_lens: `[S]` integer tensor, lengths >= 1 of the packed samples, in packing order.
        num_tokens: T, the packed length.

    Returns:
        `[T]` int64 on seq_lens' device, e.g. seq_lens [2, 3] -> [0, 0, 1, 1, 1].

    Raises:
        ValueError: seq_lens is not a non-empty 1-D integer tensor of values >= 1, or does not sum to T.
    """
    lens = validated_seq_lens(seq_lens)
    total = int(lens.sum())
    if total != num_tokens:
        raise ValueError(f"seq_lens must sum to the packed length {num_tokens}, got sum {total}")
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)


def keep_mask(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_samples: int,
    config: AipoLossConfig,
) -> torch.Tensor:
    """Which tokens the loss keeps: `loss_mask & token_ok & seq_ok`.

    token_ok[t] = token_mask_low <= exp(log_ratio[t]) <= token_mask_high
    seq_ok[t]   = geo_mask_low <= exp(mean_{u in sample(t), loss_mask[u]} log_ratio[u]) <= geo_mask_high
    (a sample with no loss tokens counts as seq_ok; NaN ratios fail both tests).
    Source: prime-rl's token and geometric-mean sequence masks (see module docstring).

    Args:
        log_ratio: `[T]` float, detached log pi_train - log pi_infer (nats).
        loss_mask: `[T]` bool, tokens that carry loss (the completion tokens).
        seq_ids: `[T]` int64, sample index of each token (see `sample_ids`).
        num_samples: S.
        config: the mask bounds.

    Returns:
        `[T]` bool.
    """
    ratio = torch.exp(log_ratio.double())
    token_ok = (ratio >= config.token_mask_low) & (ratio <= config.token_mask_high)
    lr = torch.where(loss_mask, log_ratio.double(), 0.0)
    zeros = torch.zeros(num_samples, dtype=torch.float64, device=log_ratio.device)
    lr_sum = zeros.index_add(0, seq_ids, lr)
    n_loss = zeros.index_add(0, seq_ids, loss_mask.double())
    geo = torch.exp(lr_sum / n_loss.clamp(min=1.0))
    sample_ok = (geo >= config.geo_mask_low) & (geo <= config.geo_mask_high)
    return loss_mask & token_ok & sample_ok[seq_ids]


def aipo_loss(
    lp_train: torch.Tensor,
    lp_infer: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    num_loss_tokens: int,
    config: AipoLossConfig = AipoLossConfig(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level AIPO-style GRPO loss of one packed micro-batch (formula in the module docstring).

    Args:
        lp_train: `[T]` float32, log pi_train(y_t | y_<t) from the trainer (requires grad); nats.
        lp_infer: `[T]` float, log pi_infer(y_t | y_<t) reported by the inference engine; nats;
            must be finite where loss_mask.
        advantages: `[T]` float, the sample's advantage broadcast to each of its tokens; finite
            where loss_mask.
        loss_mask: `[T]` bool, True on tokens that carry loss (completion tokens).
        seq_lens: `[S]` int, lengths (>= 1) of the packed samples, summing to T.
        num_loss_tokens: int >= 1 (numpy ints accepted), loss tokens of the WHOLE optimizer step (all micro-batches, all
            ranks), so summing the micro-batch losses gives the token mean over the step; must be
            >= this micro-batch's loss tokens.
        config: coefficients and mask bounds.

    Returns:
        loss: 0-dim tensor, dtype of lp_train, differentiable w.r.t. lp_train with
            d loss / d lp_train[t] = -keep[t] * coeff[t] / num_loss_tokens.
        stats: python floats over this micro-batch's loss tokens (masked ones included):
            `loss_tokens` (count), `masked_tokens` (loss tokens removed by the token or sequence
            mask), `kl_sum` (sum of k3 estimates of KL(pi_infer || pi_train), nats),
            `ratio_sum`, `ratio_min`, `ratio_max` (min/max are +inf/-inf if there are no loss
            tokens, the identities of min/max). Computed in float64.

    Raises:
        ValueError: shapes or dtypes disagree, seq_lens do not split T, num_loss_tokens is not an
            int >= this micro-batch's loss tokens (and >= 1), or lp_infer/advantages are not
            finite on a loss token.
    """
    num_tokens = _validate_flat_inputs(lp_train, lp_infer, advantages, loss_mask)
    seq_ids = sample_ids(seq_lens, num_tokens)
    local_loss_tokens = int(loss_mask.sum())
    if isinstance(num_loss_tokens, bool) or not hasattr(type(num_loss_tokens), "__index__"):
        raise ValueError(f"num_loss_tokens must be an int, got {type(num_loss_tokens).__name__}")
    num_loss_tokens = operator.index(num_loss_tokens)  # numpy ints accepted
    if num_loss_tokens < max(1, local_loss_tokens):
        raise ValueError(
            f"num_loss_tokens must be >= 1 and >= this micro-batch's {local_loss_tokens} loss tokens, "
            f"got {num_loss_tokens}; pass the loss-token count of the whole optimizer step"
        )
    for name, tensor in (("lp_infer", lp_infer), ("advantages", advantages)):
        bad = loss_mask & ~torch.isfinite(tensor)
        if bool(bad.any()):
            index = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{name} must be finite on loss tokens, got {float(tensor[index])} at token {index}; "
                "fix the producer/reward worker output or set loss_mask False there"
            )

    log_ratio = lp_train.detach() - lp_infer.to(lp_train.dtype)
    keep = keep_mask(log_ratio, loss_mask, seq_ids, int(seq_lens.numel()), config)
    ratio = torch.exp(log_ratio)
    coeff = ratio * (config.adv_tau * advantages.to(lp_train.dtype) - config.kl_tau * log_ratio)
    coeff = torch.where(keep, coeff, 0.0)  # already detached: built from lp_train.detach()
    loss = -(coeff * torch.where(keep, lp_train, 0.0)).sum() / num_loss_tokens
    return loss, _loss_stats(log_ratio, loss_mask, keep)


def _loss_stats(log_ratio: torch.Tensor, loss_mask: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Sums/min/max over loss tokens (float64, one host sync); see `aipo_loss` for the keys."""
    lr = log_ratio.double()[loss_mask]
    ratio = torch.exp(lr)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=lr.device)
    values = torch.stack(
        [
            loss_mask.sum().double(),
            (loss_mask & ~keep).sum().double(),
            k3_kl(lr).sum(),
            ratio.sum(),
            ratio.min() if lr.numel() else inf,
            ratio.max() if lr.numel() else -inf,
        ]
    ).tolist()
    keys = ("loss_tokens", "masked_tokens", "kl_sum", "ratio_sum", "ratio_min", "ratio_max")
    return dict(zip(keys, values))


def _validate_flat_inputs(
    lp_train: torch.Tensor, lp_infer: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor
) -> int:
    """Check the `[T]` inputs agree in shape and kind; return T."""
    if not isinstance(lp_train, torch.Tensor) or lp_train.ndim != 1 or not lp_train.dtype.is_floating_point:
        raise ValueError("lp_train must be a 1-D float tensor [num_tokens] (flat packed logprobs)")
    num_tokens = lp_train.shape[0]
    for name, tensor in (("lp_infer", lp_infer), ("advantages", advantages), ("loss_mask", loss_mask)):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (num_tokens,):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a tensor of shape [{num_tokens}] like lp_train, got {shape}")
    if not (lp_infer.dtype.is_floating_point and advantages.dtype.is_floating_point):
        raise ValueError("lp_infer and advantages must be float tensors; use .float()")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}; use .bool()")
    return num_tokens
