"""busctl's launch warning for trainer.dtype=bfloat16 on a CPU without fast bfloat16 matmuls: the
probe measures a real matmul both ways, the warning names the measured ratio and the CPU flags,
and nothing is measured or said for float32 or a CUDA trainer."""

from __future__ import annotations

import math
import re
from pathlib import Path

from busctl.cpu_bf16 import bf16_matmul_ratio, cpu_bf16_warning, cpu_flags, warning_text


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
    ratio = bf16_matmul_ratio(repeats=3)
    assert math.isfinite(ratio) and ratio > 0


def test_only_a_bf16_cpu_trainer_is_probed(monkeypatch):
    assert cpu_bf16_warning("float32", "cpu") is None
    assert cpu_bf16_warning("bfloat16", "cuda") is None
    monkeypatch.setenv("RLBUS_CPU_BF16_WARN_RATIO", "0")  # any measured ratio is over 0: the warning shows
    text = cpu_bf16_warning("bfloat16", "cpu")
    assert text is not None
    assert float(re.search(r"took ([0-9.]+)x as long", text).group(1)) > 0
    monkeypatch.setenv("RLBUS_CPU_BF16_WARN_RATIO", "1e9")
    assert cpu_bf16_warning("bfloat16", "cpu") is None
