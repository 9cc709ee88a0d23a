"""QeRL's Adaptive Quantization Noise (AQN) on the weights the producers receive.

Huang et al. 2025, "QeRL: Beyond Efficiency -- Quantization-enhanced Reinforcement Learning for
LLMs" (arXiv:2510.11696), Sec. 3.3: rollouts are sampled from a policy whose RMSNorm scale
vectors carry Gaussian noise, `w_noise = w + Z`, `Z ~ N(0, sigma^2 I)` (eq. 10; through the
following linear layer this is a row-wise multiplicative perturbation of `Wq, Wk, Wv` and
`Wgate, Wup`), a parameter-space exploration signal. `sigma` follows a stage-wise geometric decay
(eq. 8) over training; the first stage has no added noise (in the paper it relies on the
quantization noise alone; the reference code, `get_sigma_by_step`, returns 0 for interval 0).

Schedule (`qerl_sigma_trend`, `qerl_noise_sigma`), with K = `num_stages` equal stages over
`total_steps` training steps:

    stage(step) = min(floor(step * K / total_steps), K - 1)
    sigma(stage 0) = 0
    sigma(stage j) = sigma_start * (sigma_end / sigma_start) ** ((j - 1) / (K - 2)),  j = 1..K-1

i.e. the paper's eq. 8 `sigma(k) = sigma_start (sigma_end / sigma_start)^((k-1)/(K'-1))` over the
K' = K - 1 noisy stages k = 1..K', which start exactly at `sigma_start` and end exactly at
`sigma_end` (K = 2: one noisy stage at `sigma_start`). This is the reference code's layout: its
`sigma_trend` list holds the K - 1 noisy sigmas and it splits training into `len(sigma_trend) + 1`
equal intervals, the first without noise.

Where rlbus applies it: the trainer adds fresh noise (never accumulated across versions) to a COPY
of the RMSNorm weights it sends as policy version `v`, with `step = v`; its own weights stay clean.
The noise is drawn on CPU in float32 from a generator seeded by `(seed, version)`, so a version's
noisy weights are reproducible. Which tensors: the per-block `input_layernorm` and
`post_attention_layernorm` scales (the norms in front of Wq/Wk/Wv and Wgate/Wup, paper Fig. 6)
and the final `model.norm` (an RMSNorm module too, which the reference code also perturbs).
Qwen3's per-head `q_norm`/`k_norm` are left clean: they are not in the paper's scheme.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_RMSNORM_WEIGHT = re.compile(r"(^|\.)(input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$")


def qerl_sigma_trend(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """`[num_stages - 1]` sigmas of the noisy stages 1..K-1 (QeRL eq. 8, see the module docstring).

    Raises:
        ValueError: `num_stages < 2`, or a sigma that is not > 0 (the decay is geometric).
    """
    if num_stages < 2:
        raise ValueError(
            f"num_stages must be >= 2 (a noise-free first stage + at least one noisy one), got {num_stages}"
        )
    if not (sigma_start > 0 and sigma_end > 0):
        raise ValueError(f"sigma_start and sigma_end must be > 0 for a geometric decay, got {sigma_start}, {sigma_end}")
    noisy = num_stages - 1
    if noisy == 1:
        return [float(sigma_start)]
    ratio = sigma_end / sigma_start
    return [float(sigma_start * ratio ** (k / (noisy - 1))) for k in range(noisy)]


def qerl_noise_stage(step: int, total_steps: int, num_stages: int) -> int:
    """Stage `min(floor(step * K / total_steps), K - 1)` of `step` (K = `num_stages` equal stages).

    Raises:
        ValueError: `total_steps < 1`, `step < 0` or `num_stages < 1`.
    """
    if total_steps < 1 or step < 0 or num_stages < 1:
        raise ValueError(f"need total_steps >= 1, step >= 0, num_stages >= 1; got {total_steps}, {step}, {num_stages}")
    return min(step * num_stages // total_steps, num_stages - 1)


def qerl_noise_sigma(step: int, total_steps: int, *, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """Noise std for the weights of training step `step` of `total_steps` (0 in stage 0).

    Raises:
        ValueError: as `qerl_sigma_trend` and `qerl_noise_stage`.
    """
    trend = qerl_sigma_trend(sigma_start, sigma_end, num_stages)
    stage = qerl_noise_stage(step, total_steps, num_stages)
    return 0.0 if stage == 0 else trend[stage - 1]


def is_rmsnorm_weight(name: str) -> bool:
    """Whether HF weight `name` is a noised RMSNorm scale (`*.input_layernorm.weight`,
    `*.post_attention_layernorm.weight`, `model.norm.weight`)."""
    return _RMSNORM_WEIGHT.search(name) is not None


def noise_generator(seed: int, version: int) -> torch.Generator:
    """CPU generator of version `version`'s noise: seeded with `seed * 1_000_003 + version`."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(version))


def with_rmsnorm_noise(
    state_dict: Mapping[str, torch.Tensor], sigma: float, *, seed: int, version: int
) -> dict[str, torch.Tensor]:
    """A shallow copy of `state_dict` whose RMSNorm weights are NEW tensors `w + N(0, sigma^2)`.

    Other entries are the same tensor objects (no copy); the input and its tensors are never
    modified, so the trainer's weights stay clean. Noise is drawn in float32 on CPU, entry by entry
    in the mapping's order, from `noise_generator(seed, version)`, added in float32, then cast back
    to each weight's dtype and device (QeRL eq. 10: `w_noise = Z + w`). `sigma == 0` returns a
    plain copy.

    Raises:
        ValueError: `sigma < 0` or not finite.
    """
    if not (sigma >= 0 and sigma != float("inf")):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    out = dict(state_dict)
    if sigma == 0:
        return out
    generator = noise_generator(seed, version)
    for name, weight in state_dict.items():
        if is_rmsnorm_weight(name):
            noise = torch.randn(tuple(weight.shape), generator=generator, dtype=torch.float32) * sigma
            noisy = weight.detach().to(device="cpu", dtype=torch.float32) + noise
            out[name] = noisy.to(device=weight.device, dtype=weight.dtype)
    return out
