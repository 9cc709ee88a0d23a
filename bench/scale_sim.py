"""Simulated producers, reward workers and trainer for the scale simulation (:mod:`bench.scale`).

Each simulated worker speaks the real protocol on the real bus (its own :class:`bus.courier.Courier`, control
PUB and SUB, the real message types), so the real prompt source, packer and hub cannot tell it from a real
component: :class:`SimProducer` turns prompts into rollout groups after ``tokens / tokens_per_s`` seconds
(lognormal lengths) and applies weights after ``apply_s``; :class:`SimReward` scores them 0/1 with GRPO
advantages after ``score_s``; :class:`SimTrainer` takes each step's micro-batches, waits ``step_s``, publishes
the next version and releases the step at once. Every worker records timestamped events for per-hop latency
(wall-clock, one host); a :class:`ControlProbe` per process times the hub's ``trainer.step`` fan-out.
Invariant: a simulated worker keeps the custody rules, so a simulated run's accounting is as strict as a real
one's.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from bus.control import ControlPublisher
from bus.courier import Courier
from configs.bus_limits import DEFAULT_MAX_INFLIGHT_BYTES
from bus.messages import (
    GroupsTrained,
    MicroBatch,
    Prompt,
    RolloutGroup,
    RunDone,
    ScoredGroup,
    TrainerStep,
    WeightsApplied,
    WeightsReady,
    new_id,
)
from bus.sockets import BusSocket
from bus.topics import Endpoints
from rewards.advantages import compute_advantages
from trainer.state.step_ledger import group_id


@dataclass(frozen=True)
class SimSpec:
    """The simulated load of one sweep point.

    Attributes:
        group_size: G, completions per prompt (e.g. 8-16).
        median_tokens: median completion length, tokens (lognormal, sigma ``sigma``).
        sigma: lognormal shape; lengths are clipped to ``[1, max_tokens]``.
        max_tokens: longest completion, tokens.
        prompt_tokens: prompt length, tokens.
        tokens_per_s: generation throughput of one producer, completion tokens per second.
        score_s: scoring time of one group in a reward worker, seconds.
        step_s: optimizer step time of the trainer, seconds.
        apply_s: weight update time in a producer, seconds.
    """

    group_size: int = 8
    median_tokens: int = 1024
    sigma: float = 0.5
    max_tokens: int = 4096
    prompt_tokens: int = 128
    tokens_per_s: float = 50_000.0
    score_s: float = 0.005
    step_s: float = 0.2
    apply_s: float = 0.0

    def __post_init__(self) -> None:
        if self.group_size < 2 or self.median_tokens < 1 or self.max_tokens < self.median_tokens:
            raise ValueError(f"need group_size >= 2 and 1 <= median_tokens <= max_tokens, got {self}")
        if self.tokens_per_s <= 0 or min(self.score_s, self.step_s, self.apply_s, self.sigma) < 0:
            raise ValueError(f"tokens_per_s must be > 0 and times / sigma >= 0, got {self}")


@dataclass
class Events:
    """Timestamped events of one simulated worker (thread-confined; merged by the process):
    ``hops``, ``(event, id, t)`` rows, ``t`` wall-clock seconds."""

    hops: list[tuple[str, str, float]] = field(default_factory=list)

    def hop(self, event: str, ident: str) -> None:
        """Record ``event`` of ``ident`` now."""
        self.hops.append((event, ident, time.time()))


class ControlProbe:
    """One thread per process that reads every worker's control SUB socket the moment a message
    arrives (a zmq poller over all of them), records each ``trainer.step``'s fan-out delay, and
    hands the messages to the workers through queues: the fan-out time measured is the hub's and
    the sockets', not a busy worker's.

    Attributes:
        fanout: ``(step, delay_s)`` per ``trainer.step`` received by any worker of the process.
    """

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.fanout: list[tuple[int, float]] = []
        self._socks: list[tuple[BusSocket, queue.SimpleQueue]] = []
        self._thread = threading.Thread(target=self._loop, name="control-probe", daemon=True)

    def add(self, sock: BusSocket) -> queue.SimpleQueue:
        """Read ``sock`` from now on (call before :meth:`start`); returns the worker's queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._socks.append((sock, q))
        return q

    def start(self) -> None:
        """Start the reading thread."""
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread to end (after ``stop``), before the sockets are closed."""
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        poller = zmq.Poller()
        by_sock = {}
        for sock, q in self._socks:
            poller.register(sock.sock, zmq.POLLIN)
            by_sock[sock.sock] = (sock, q)
        while not self.stop.is_set():
            for zsock, _ in poller.poll(50):
                sock, q = by_sock[zsock]
                msg = sock.recv_ready()
                if msg is None:
                    continue
                if isinstance(msg, TrainerStep) and "sim_sent_at" in msg.metrics:
                    self.fanout.append((msg.step, time.time() - msg.metrics["sim_sent_at"]))
                q.put(msg)


class SimWorker:
    """Base of a simulated worker: courier, control PUB/SUB, stop event, events, a thread.

    Args:
        ctx: the process's zmq context (shared by the process's workers; one socket set each).
        endpoints: the run's endpoints. name: e.g. ``"producer-3"``. spec: the load.
        bus_timing: ``(heartbeat_s, dead_after_s, ack_timeout_s)`` of the run's ``bus`` config.
        max_inflight_bytes: the run's ``bus.max_inflight_bytes`` (byte bound of the credit windows).
        stop: set by the process on exit; the worker also stops at ``run.done``.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoints: Endpoints,
        name: str,
        spec: SimSpec,
        bus_timing: tuple[float, float, float],
        stop: threading.Event,
        probe: ControlProbe,
        max_inflight_bytes: int | dict[str, int] = DEFAULT_MAX_INFLIGHT_BYTES,
    ) -> None:
        self.name, self.spec, self.endpoints, self.stop = name, spec, endpoints, stop
        heartbeat_s, dead_after_s, ack_timeout_s = bus_timing
        self.courier = Courier(
            ctx,
            heartbeat_s=heartbeat_s,
            dead_after_s=dead_after_s,
            ack_timeout_s=ack_timeout_s,
            stop=stop,
            max_inflight_bytes=max_inflight_bytes,
        )
        self.control_out = ControlPublisher(ctx, endpoints.address("control_pub"), stop=stop)
        self.control_in = BusSocket(ctx, "control_sub", "recv", endpoints.address("control_sub"), bind=False, stop=stop)
        self._control_queue = probe.add(self.control_in)  # read by the process's probe thread
        self.events = Events()
        self.rng = np.random.default_rng(abs(hash(name)) % (1 << 32))
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        """Run :meth:`loop` on the worker's thread."""
        self.thread.start()

    def _main(self) -> None:
        try:
            self.loop()
        finally:
            self.stop.set()  # one worker done (run.done) or failed: its process winds down

    def loop(self) -> None:
        """The worker's main loop (subclasses)."""
        raise NotImplementedError

    def poll_control(self) -> bool:
        """Handle waiting control messages; False once ``run.done`` arrived."""
        while True:
            try:
                msg = self._control_queue.get_nowait()
            except queue.Empty:
                return True
            if isinstance(msg, RunDone):
                return False
            self.on_control(msg)

    def on_control(self, msg: object) -> None:
        """Hook: a control message other than ``run.done``."""

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` while serving the control channel; False at ``run.done`` or stop."""
        deadline = time.monotonic() + seconds
        while True:
            if not self.poll_control() or self.stop.is_set():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))

    def close(self) -> None:
        """Close the courier (goodbye to senders) and the control sockets."""
        self.courier.close()
        self.control_out.close()
        self.control_in.close()


class SimProducer(SimWorker):
    """A simulated rollout producer (see the module docstring); ``index`` picks ``rollouts/index``."""

    def __init__(self, *args, index: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0
        self.prompts = self.courier.receiver("prompts", self.endpoints.address("prompts"), bind=False, accept=(Prompt,))
        self.rollouts = self.courier.sender("rollouts", self.endpoints.address("rollouts", index), bind=True)

    def on_control(self, msg: object) -> None:
        if isinstance(msg, WeightsReady) and msg.version > self.version:
            if self.spec.apply_s:
                time.sleep(self.spec.apply_s)
            self.version = msg.version
            self.control_out.send(
                WeightsApplied(id=new_id(), producer=self.name, version=self.version, apply_time_s=self.spec.apply_s)
            )

    def make_group(self, prompt: Prompt, gen_time_s: float) -> RolloutGroup:
        """A ``RolloutGroup`` for ``prompt`` with lognormal completion lengths, all at :attr:`version`."""
        s, g = self.spec, self.spec.group_size
        lens = np.clip(np.rint(self.rng.lognormal(np.log(s.median_tokens), s.sigma, g)), 1, s.max_tokens).astype(
            np.int32
        )
        n = int(lens.sum())
        versions = np.full(g, self.version, np.int64)
        return RolloutGroup(
            id=prompt.id,
            prompt_index=prompt.index,
            step=prompt.step,
            task=prompt.task,
            info=prompt.info,
            producer=self.name,
            completion_texts=[""] * g,
            finish_reasons=["stop"] * g,
            gen_time_s=gen_time_s,
            prompt_ids=np.arange(s.prompt_tokens, dtype=np.int32) % 1000,
            completion_ids=self.rng.integers(0, 32_000, n, dtype=np.int32),
            completion_lens=lens,
            sampler_logprobs=np.full(n, -1.0, np.float32),
            version_start=versions,
            version_end=versions,
            temperature=prompt.temperature,
            eval_round=prompt.eval_round,
            eval_size=prompt.eval_size,
        )

    def loop(self) -> None:
        self.control_out.send(WeightsApplied(id=new_id(), producer=self.name, version=0, apply_time_s=0.0))
        while self.poll_control() and not self.stop.is_set():
            prompt = self.prompts.recv(timeout_s=0.05)
            if prompt is None:
                continue
            self.events.hop("prompt_recv", prompt.id)
            started = time.perf_counter()
            group = self.make_group(prompt, 0.0)
            gen_s = int(group.completion_lens.sum()) / self.spec.tokens_per_s
            if not self.wait(gen_s - (time.perf_counter() - started)):
                return
            self.events.hop("rollout_sent", group.id)
            if not self.rollouts.send(group, upstream=(self.prompts, prompt.id)):
                return


class SimReward(SimWorker):
    """A simulated reward worker connected to ``num_producers`` rollouts endpoints."""

    def __init__(self, *args, num_producers: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        eps = [self.endpoints.address("rollouts", i) for i in range(num_producers)]
        self.rollouts = self.courier.receiver("rollouts", eps, bind=False, accept=(RolloutGroup,))
        self.scored = self.courier.sender("scored", self.endpoints.address("scored"), bind=False)

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """0/1 rewards and GRPO advantages for ``group`` (every field of the group is kept)."""
        rewards = self.rng.integers(0, 2, group.group_size).astype(np.float32)
        advantages = compute_advantages("grpo", rewards, np.asarray(group.completion_lens, np.int64))
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(RolloutGroup)}
        return ScoredGroup(**fields, reward_worker=self.name, rewards=rewards, advantages=advantages.astype(np.float32))

    def loop(self) -> None:
        while self.poll_control() and not self.stop.is_set():
            group = self.rollouts.recv(timeout_s=0.05)
            if group is None:
                continue
            self.events.hop("rollout_recv", group.id)
            if not self.wait(self.spec.score_s):
                return
            scored = self.score(group)
            self.events.hop("scored_sent", group.id)
            if not self.scored.send(scored, upstream=(self.rollouts, group.id)):
                return


class SimTrainer(SimWorker):
    """The simulated trainer: ``max_steps`` steps of ``step_s`` seconds each (see the module docstring).

    Attributes:
        trained: every trained sample id (a second one is counted in :attr:`duplicates`).
    """

    def __init__(self, *args, max_steps: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_steps = max_steps
        self.batches = self.courier.receiver(
            "batches", self.endpoints.address("batches"), bind=False, accept=(MicroBatch,)
        )
        self.outcomes = self.courier.sender("outcomes", self.endpoints.address("outcomes"), bind=False)
        self.buffer: dict[int, dict[str, MicroBatch]] = {}
        self.trained: set[str] = set()
        self.duplicates = 0

    def _take(self, step: int) -> list[MicroBatch] | None:
        """Step ``step``'s micro-batches once all arrived (others buffered); None if stopped."""
        while True:
            got = self.buffer.get(step, {})
            if got and len(got) == next(iter(got.values())).num_micro_batches:
                return list(self.buffer.pop(step).values())
            if self.stop.is_set():
                return None
            self.poll_control()
            mb = self.batches.recv(timeout_s=0.05)
            if mb is None:
                continue
            if mb.step < step:  # a re-send of a released step
                self.batches.done(mb.id)
                continue
            if not self.buffer.get(mb.step):
                self.events.hop("batch_first", str(mb.step))
            self.buffer.setdefault(mb.step, {})[mb.id] = mb

    def loop(self) -> None:
        for step in range(self.max_steps):
            mbs = self._take(step)
            if mbs is None:
                return
            samples = [s for mb in mbs for s in mb.sample_ids]
            groups = list(dict.fromkeys(group_id(s) for s in samples))
            for g in groups:
                self.events.hop("batch_group", f"{step}/{g}")
            time.sleep(self.spec.step_s)
            self.duplicates += sum(s in self.trained for s in samples)
            self.trained.update(samples)
            self.control_out.send(
                WeightsReady(id=new_id(), version=step + 1, method="filesystem", manifest=[], path="", num_bytes=0)
            )
            msg = GroupsTrained(id=f"trained-step-{step}", step=step, group_ids=groups)
            self.outcomes.send(msg)
            self.control_out.send(msg)
            self.batches.done(*(mb.id for mb in mbs))
            self.events.hop("trained", str(step))
            self.control_out.send(
                TrainerStep(id=new_id(), step=step + 1, version=step + 1, metrics={"sim_sent_at": time.time()})
            )
        deadline = time.monotonic() + 30
        while self.outcomes.unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.control_out.send(RunDone(id=new_id(), step=self.max_steps, reason="max_steps"))
