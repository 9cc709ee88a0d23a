"""A warning at launch when ``trainer.dtype: bfloat16`` is chosen on a CPU without bfloat16 matmul units.

Without bfloat16 dot-product instructions (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``) torch emulates
bfloat16 matmuls: on an AMD EPYC (issue 28) a 4096x64 @ 64x192 matmul took 96 ms in bfloat16 and 6 ms in
float32, the default job's trainer step 4.2 s against 0.65 s. ``busctl up`` times that matmul both ways when the
trainer runs bfloat16 on the CPU and warns when bfloat16 is over :data:`WARN_RATIO` times slower.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

__all__ = ["BF16_CPU_FLAGS", "WARN_RATIO", "bf16_matmul_ratio", "cpu_bf16_warning", "cpu_flags", "warning_text"]

WARN_RATIO = 2.0
"""bfloat16 / float32 time of the probe matmul above which ``busctl up`` warns (env
``RLBUS_CPU_BF16_WARN_RATIO`` overrides). With bf16 units the ratio is ~0.3-1.5; without, 5-20."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of bfloat16 matmul instructions (x86 AVX-512 BF16, AMX, Arm BF16)."""

PROBE_SHAPE = (4096, 64, 192)
"""(rows, inner, cols) of the probe matmul: one attention-sized projection of the default job."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags of the first processor in ``cpuinfo`` (empty when unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def bf16_matmul_ratio(repeats: int = 5) -> float:
    """Median time of the probe matmul in bfloat16 over its median time in float32 (same thread count).

    Returns:
        The ratio (dimensionless, > 0); > 1 means bfloat16 is slower.
    """
    import torch

    rows, inner, cols = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, cols, generator=gen)

    def median_s(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # warm-up: the first call picks the kernel
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    fp32 = median_s(a, b)
    return median_s(a.bfloat16(), b.bfloat16()) / max(fp32, 1e-9)


def warning_text(ratio: float, flags: set[str], threshold: float = WARN_RATIO) -> str | None:
    """The warning for a measured ``ratio`` (None when bfloat16 is not over ``threshold`` times slower)."""
    if ratio <= threshold:
        return None
    have = sorted(flags & set(BF16_CPU_FLAGS))
    units = f"it reports {', '.join(have)}" if have else f"no {'/'.join(BF16_CPU_FLAGS)} flag in /proc/cpuinfo"
    rows, inner, cols = PROBE_SHAPE
    return (
        f"trainer.dtype=bfloat16 on a CPU without fast bfloat16 matmuls ({units}): a {rows}x{inner} @ "
        f"{inner}x{cols} matmul took {ratio:.1f}x as long in bfloat16 as in float32 here, so the trainer's "
        "steps will be several times slower than in float32 (seen: 4.2 s against 0.65 s per step); "
        "trainer.dtype=float32 is faster on this host"
    )


def cpu_bf16_warning(trainer_dtype: str, trainer_device: str) -> str | None:
    """The launch warning for the resolved trainer section, or None (not bfloat16, not on the CPU,
    or bfloat16 fast enough here). Measures the probe only when the trainer runs bfloat16 on the CPU."""
    if trainer_dtype != "bfloat16" or trainer_device != "cpu":
        return None
    threshold = float(os.environ.get("RLBUS_CPU_BF16_WARN_RATIO", WARN_RATIO))
    return warning_text(bf16_matmul_ratio(), cpu_flags(), threshold)
