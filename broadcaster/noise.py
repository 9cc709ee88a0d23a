"""QeRL's Adaptive Quantization Noise on the weights the producers receive (Huang et al. 2025, arXiv:2510.11696,
Sec. 3.3): RMSNorm scales carry `w_noise = w + Z`, `Z ~ N(0, sigma^2 I)` (eq. 10), with K = `num_stages` equal
stages over `total_steps`:

    stage(step) = min(floor(step * K / total_steps), K - 1);  sigma(stage 0) = 0
    sigma(stage j) = sigma_start * (sigma_end / sigma_start) ** ((j - 1) / (K - 2)),  j = 1..K-1   # eq. 8

(the reference code's layout, `get_sigma_by_step`: K - 1 noisy stages after a clean one). The trainer adds fresh
noise to a COPY of the RMSNorm weights it sends as version `v` (`step = v`), drawn on CPU in float32 from a
generator seeded by `(seed, version)`. Noised: `input_layernorm`, `post_attention_layernorm` (paper Fig. 6) and
`model.norm` (as the reference code); Qwen3's `q_norm`/`k_norm` stay clean.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_RMSNORM_WEIGHT = re.compile(r"(^|\.)(input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$")


def qerl_sigma_trend(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """`[num_stages - 1]` sigmas of the noisy stages 1..K-1 (QeRL eq. 8); ValueError: K < 2 or a sigma <= 0."""
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
    """`min(floor(step * K / total_steps), K - 1)`; ValueError: `total_steps < 1`, `step < 0` or `K < 1`."""
    if total_steps < 1 or step < 0 or num_stages < 1:
        raise ValueError(f"need total_steps >= 1, step >= 0, num_stages >= 1; got {total_steps}, {step}, {num_stages}")
    return min(step * num_stages // total_steps, num_stages - 1)


def qerl_noise_sigma(step: int, total_steps: int, *, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """Noise std for step `step` of `total_steps` (0 in stage 0); raises as the two functions above."""
    trend = qerl_sigma_trend(sigma_start, sigma_end, num_stages)
    stage = qerl_noise_stage(step, total_steps, num_stages)
    return 0.0 if stage == 0 else trend[stage - 1]


def is_rmsnorm_weight(name: str) -> bool:
    """Whether HF weight `name` is a noised RMSNorm scale."""
    return _RMSNORM_WEIGHT.search(name) is not None


def noise_generator(seed: int, version: int) -> torch.Generator:
    """CPU generator of version `version`'s noise: seeded with `seed * 1_000_003 + version`."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(version))


def with_rmsnorm_noise(
    state_dict: Mapping[str, torch.Tensor], sigma: float, *, seed: int, version: int
) -> dict[str, torch.Tensor]:
    """A shallow copy of `state_dict` whose RMSNorm weights are NEW tensors `w + N(0, sigma^2)` (QeRL eq. 10).
    The input is never modified. Noise: float32 on CPU in mapping order, cast back to each weight's dtype and
    device. ValueError: `sigma` negative or not finite."""
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
