"""busctl's launch warning for trainer.dtype=bfloat16 on a CPU without fast bfloat16 matmuls: the
probe measures a real matmul both ways, the warning names the measured ratio and the CPU flags,
and nothing is measured or said for float32 or a CUDA trainer."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from busctl.cpu_bf16 import PROBE_SHAPE, bf16_matmul_ratio, cpu_bf16_warning, cpu_flags, warning_text

ROWS, INNER, COLS = PROBE_SHAPE


class MatmulLog(TorchDispatchMode):
    """Records ``(dtype, operand shapes)`` of every ``aten.mm`` run inside it (the probe's matmuls)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            a, b = args[0], args[1]
            assert a.dtype == b.dtype, (a.dtype, b.dtype)
            self.calls.append((a.dtype, (tuple(a.shape), tuple(b.shape))))
        return func(*args, **(kwargs or {}))


def test_flags_are_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx2", "avx512f"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_warning_names_the_ratio_and_the_missing_units():
    text = warning_text(16.0, {"avx2", "avx512f"})
    assert text is not None and "16.0x" in text and "no avx512_bf16/amx_bf16/bf16 flag" in text
    assert "trainer.dtype=float32" in text
    assert "it reports amx_bf16" in warning_text(3.0, {"amx_bf16"})
    assert warning_text(1.2, set()) is None  # fast enough: silent
    assert warning_text(1.2, set(), threshold=1.0) is not None


def test_probe_measures_a_real_ratio():
    with MatmulLog() as log:
        ratio = bf16_matmul_ratio(repeats=3)
    assert math.isfinite(ratio) and ratio > 0
    probe = ((ROWS, INNER), (INNER, COLS))
    # a warm-up and 3 timed matmuls in float32, then the same in bfloat16
    assert log.calls == [(torch.float32, probe)] * 4 + [(torch.bfloat16, probe)] * 4, log.calls


def test_only_a_bf16_cpu_trainer_is_probed(monkeypatch):
    monkeypatch.setenv("RLBUS_CPU_BF16_WARN_RATIO", "0")  # any measured ratio is over 0: the warning shows
    with MatmulLog() as log:
        assert cpu_bf16_warning("float32", "cpu") is None
        assert cpu_bf16_warning("bfloat16", "cuda") is None
    assert log.calls == []  # no probe ran
    with MatmulLog() as log:
        text = cpu_bf16_warning("bfloat16", "cpu")
    assert text is not None
    assert [dtype for dtype, _ in log.calls].count(torch.bfloat16) > 1  # the probe ran, in bfloat16 too
    assert float(re.search(r"took ([0-9.]+)x as long", text).group(1)) > 0
    monkeypatch.setenv("RLBUS_CPU_BF16_WARN_RATIO", "1e9")
    assert cpu_bf16_warning("bfloat16", "cpu") is None
