"""Fixtures for bus tests over a real ZeroMQ bus (pyzmq-style).

Every socket a test opens goes through a tracking factory and is closed with ``linger=0`` at
teardown, every :class:`bus.courier.Courier` through ``couriers`` (closed before the context);
endpoints are ``ipc://`` files under the short :func:`bus.topics.socket_dir` of the test's
``tmp_path`` (or ``tcp://127.0.0.1:*`` random ports); receives always have a timeout.
``example(type_name)`` builds one valid instance of every registered message type.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from bus.hub import ControlHub
from bus.messages_api import ApiCall, ApiReply
from bus.messages_weights import WeightGroup, WeightGroupAck, WeightsBucket, WeightsRequest
from bus.messages import (
    ComponentHeartbeat,
    ComponentReady,
    GroupsDropped,
    GroupsTrained,
    Message,
    MicroBatch,
    Prompt,
    RolloutGroup,
    RunDone,
    RunFinalStep,
    RunFinish,
    EvalResult,
    ScoredGroup,
    ServersScaled,
    ServersWanted,
    TrainerStep,
    WeightsApplied,
    WeightsWanted,
    WeightsReady,
)
from bus.courier import Courier
from bus.sockets import BusSocket
from bus.topics import socket_dir
from reliable_peer import FAST
from tests import waiting
from tests.socket_dirs import remove_outside_socket_dir

RECV_TIMEOUT_S = 2.0
"""Longest any test waits for a message that should arrive, seconds."""


# -- example messages ------------------------------------------------------------------------------


def _rollout_fields() -> dict[str, Any]:
    # G = 3 completions of lengths 2, 0, 3 (an empty completion is legal): N = 5 tokens.
    return dict(
        prompt_index=7,
        step=2,
        task="reverse_text",
        info={"target": "cba", "nested": [1, 2.5, None, True]},
        producer="producer-0",
        completion_texts=["cb", "", "cba"],
        finish_reasons=["stop", "length", "stop"],
        gen_time_s=1.25,
        prompt_ids=np.array([101, 102, 103, 104], dtype=np.int32),
        completion_ids=np.array([5, 6, 7, 8, 9], dtype=np.int32),
        completion_lens=np.array([2, 0, 3], dtype=np.int32),
        sampler_logprobs=np.array([-0.5, -1.25, -0.125, -2.0, -0.0625], dtype=np.float32),
        version_start=np.array([1, 2, 2], dtype=np.int64),
        version_end=np.array([2, 2, 3], dtype=np.int64),
        # sample 0: 1 token of version 1, 1 of version 2 (a partial rollout); sample 1: no tokens, no
        # spans; sample 2: 1 token of version 2, then 2 of version 3
        version_spans=np.array([[1, 1], [2, 1], [2, 1], [3, 2]], dtype=np.int64),
        version_span_counts=np.array([2, 0, 2], dtype=np.int32),
        temperature=0.75,
        teacher_logprobs=np.array([-0.25, -1.0, -0.5, -3.0, -0.125], dtype=np.float32),
        # sample 2 is a 2-turn episode: model token, one environment token, model token
        loss_mask=np.array([True, True, True, False, True]),
        env_rewards=np.array([0.5, 0.0, 1.0], dtype=np.float32),
        prompt_messages=[{"role": "system", "content": "Reverse."}, {"role": "user", "content": "abc"}],
    )


def _micro_batch(num_tokens: int = 7, micro_index: int = 1, step: int = 4) -> MicroBatch:
    # Two samples of lengths 3 and num_tokens - 3 packed into one row.
    seq_lens = np.array([3, num_tokens - 3], dtype=np.int32)
    return MicroBatch(
        id=f"{step}:{micro_index}",
        step=step,
        micro_index=micro_index,
        num_micro_batches=max(3, micro_index + 1),
        step_loss_tokens=11,
        step_samples=2,
        sample_ids=["g1/0", "g2/1"],
        input_ids=(np.arange(num_tokens, dtype=np.int32) * 3 + 1),
        seq_lens=seq_lens,
        loss_mask=(np.arange(num_tokens) % 3 != 0),
        sampler_logprobs=-np.linspace(0, 1, num_tokens, dtype=np.float32),
        advantages=np.linspace(-1, 1, num_tokens, dtype=np.float32),
        rewards=np.array([1.0, 0.0], dtype=np.float32),
        oldest_versions=np.array([3, 4], dtype=np.int64),
        teacher_logprobs=-np.linspace(0.5, 2, num_tokens, dtype=np.float32),
        # sample 0 (3 tokens) at version 3; sample 1 at 4, its last token at 5 (a partial rollout)
        token_versions=np.array([3, 3, 3, *[4] * (num_tokens - 4), 5], dtype=np.int64),
        temperature=0.9,
        reward_terms={"correct": [1.0, 0.0], "format": [0.5, 1.0]},
    )


EXAMPLES: dict[str, Callable[[], Message]] = {
    "prompt": lambda: Prompt(
        id="p-1",
        index=3,
        step=1,
        task="reverse_text",
        messages=[{"role": "system", "content": "Reverse."}, {"role": "user", "content": "abc"}],
        info={"target": "cba", "len": 3},
        temperature=0.7,
    ),
    "rollout": lambda: RolloutGroup(id="g-1", **_rollout_fields()),
    "scored": lambda: ScoredGroup(
        id="g-1",
        **_rollout_fields(),
        reward_worker="rewards-1",
        rewards=np.array([1.0, 0.0, 0.5], dtype=np.float32),
        advantages=np.array([0.75, -1.0, 0.25], dtype=np.float32),
        reward_terms={"correct": [1.0, 0.0, 0.0], "format": [0.0, 0.0, 1.0]},
        flags=["", "repetition", "gibberish,repetition"],
        masked=np.array([False, True, True]),
    ),
    "micro_batch": _micro_batch,
    "weights.ready": lambda: WeightsReady(
        id="w-3",
        version=3,
        method="broadcast",
        manifest=[["model.embed_tokens.weight", "bfloat16", [32, 8]], ["lm_head.weight", "bfloat16", [32, 8]]],
        path="",
        num_bytes=1024,
    ),
    "weights.applied": lambda: WeightsApplied(id="a-3", producer="producer-1", version=3, apply_time_s=0.5),
    "weights.wanted": lambda: WeightsWanted(id="w-4", producer="producer-1", version=4),
    "weights.group": lambda: WeightGroup(
        id="g-1", generation=1, host="127.0.0.1", port=29_556, members=["producer-0", "producer-1"], filesystem=[]
    ),
    "weights.group_ack": lambda: WeightGroupAck(id="k-1", producer="producer-1", generation=1),
    "weights.request": lambda: WeightsRequest(id="q-1", producer="producer-1", version=3, buckets=[0, 1]),
    "weights.bucket": lambda: WeightsBucket(
        id="b-1",
        version=3,
        index=1,
        num_buckets=2,
        bucket_bytes=1 << 20,
        crc32=123_456,
        data=np.arange(256, dtype=np.uint8),
    ),
    "api.call": lambda: ApiCall(
        id="c-1",
        op="forward_backward",
        model_id="s-1:train:0",
        body={"loss_fn": "cross_entropy", "loss_inputs": ["target_tokens"]},
        token_ids=np.array([5, 6, 7], dtype=np.int64),
        datum_lens=np.array([2, 1], dtype=np.int64),
        loss_inputs=np.array([[6.0, 7.0, 8.0]]),
    ),
    "api.reply": lambda: ApiReply(
        id="a-1",
        call_id="c-1",
        ok=True,
        error="",
        category="",
        body={"outputs": ["logprobs"]},
        outputs=np.zeros((1, 3)),
    ),
    "trainer.step": lambda: TrainerStep(id="s-3", step=3, version=3, metrics={"loss": 0.25, "reward_mean": 0.5}),
    "groups.dropped": lambda: GroupsDropped(id="d-1", group_ids=["g-1", "g-2"], reason="stale"),
    "groups.trained": lambda: GroupsTrained(id="t-3", step=3, group_ids=["g-1", "g-2", "g-3"]),
    "run.done": lambda: RunDone(id="r-1", step=10, reason="max_steps"),
    "run.finish": lambda: RunFinish(id="f-1"),
    "run.final_step": lambda: RunFinalStep(id="f-2", step=7),
    "servers.wanted": lambda: ServersWanted(id="v-1", servers=3),
    "servers.scaled": lambda: ServersScaled(id="v-2", producer="producer-0", request="v-1", servers=3, error=""),
    "eval.result": lambda: EvalResult(
        id="e-1",
        round=10,
        task="gsm8k",
        version_min=10,
        version_max=10,
        num_samples=64,
        num_failed=1,
        metrics={"reward_mean": 0.25, "reward_std": 0.433, "completion_len_mean": 112.5},
    ),
    "component.ready": lambda: ComponentReady(
        id="c-1", name="rewards-1", pid=1234, metrics_port=9100, metrics_host="10.0.0.2"
    ),
    "component.heartbeat": lambda: ComponentHeartbeat(
        id="h-1",
        name="rewards-1",
        pid=1234,
        state="running",
        failures={
            "judge": {
                "kind": "reward",
                "calls": 64,
                "errors": 40,
                "share": 0.625,
                "window": 64,
                "error": "TypeError",
                "message": "unsupported operand",
                "level": "stop",
            }
        },
    ),
}


def make_example(type_name: str) -> Message:
    """One valid message of ``type_name``; fails the test if no example exists for it."""
    if type_name not in EXAMPLES:
        pytest.fail(f"no example for message type {type_name!r}: add one to EXAMPLES in tests/bus/conftest.py")
    return EXAMPLES[type_name]()


@pytest.fixture
def example() -> Callable[[str], Message]:
    return make_example


@pytest.fixture
def micro_batch() -> Callable[..., MicroBatch]:
    return _micro_batch


def _assert_same_message(got: Message, want: Message) -> None:
    """``got`` equals ``want`` field by field: same types, arrays of the same native dtype,
    shape and values."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray), f.name
            assert a.dtype == b.dtype and a.dtype.isnative, (f.name, a.dtype, b.dtype)
            assert a.shape == b.shape, (f.name, a.shape, b.shape)
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert type(a) is type(b) and a == b, (f.name, a, b)


@pytest.fixture
def assert_same_message() -> Callable[[Message, Message], None]:
    return _assert_same_message


# -- sockets ---------------------------------------------------------------------------------------


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes anything a test leaked; never blocks


@pytest.fixture
def endpoint(tmp_path: Path):
    """``endpoint(name)`` -> a fresh ``ipc://`` endpoint in the short socket dir of ``tmp_path``."""
    sock_dir = socket_dir(tmp_path)
    sock_dir.mkdir(parents=True, exist_ok=True)
    yield lambda name: f"ipc://{sock_dir / name}"
    remove_outside_socket_dir(tmp_path)


class Sockets:
    """Tracks raw and bus sockets of one test and closes them all with ``linger=0``."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.raw: list[zmq.Socket] = []

    def socket(self, socket_type: int) -> zmq.Socket:
        sock = self.ctx.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        self.raw.append(sock)
        return sock

    def bus(self, topic: str, direction: str, endpoint: str, *, bind: bool, **kw: Any) -> BusSocket:
        bs = BusSocket(self.ctx, topic, direction, endpoint, bind=bind, **kw)
        self.raw.append(bs.sock)
        return bs

    def close(self) -> None:
        for sock in self.raw:
            sock.close(linger=0)


@pytest.fixture
def sockets(ctx):
    tracker = Sockets(ctx)
    yield tracker
    tracker.close()


@pytest.fixture
def couriers(ctx):
    """``couriers(ctx=None, **timings)`` -> a new :class:`bus.courier.Courier` (one per simulated
    process; on the test's ``ctx`` unless given), with :data:`reliable_peer.FAST` unless overridden.
    All are closed at teardown, before any context is destroyed."""
    made: list[Courier] = []

    def make(context: zmq.Context | None = None, **timings: float) -> Courier:
        made.append(Courier(context or ctx, **{**FAST, **timings}))
        return made[-1]

    yield make
    for courier in made:
        courier.stop.set()
        courier.close()


def _wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return waiting.wait_until(predicate, what, timeout_s)


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    return _wait_until


def _recv_frames(sock: zmq.Socket, timeout_s: float = RECV_TIMEOUT_S) -> list[zmq.Frame]:
    """Receive one multipart message (zero-copy frames) or fail after ``timeout_s``."""
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        pytest.fail(f"no message within {timeout_s} s")
    return sock.recv_multipart(copy=False)


@pytest.fixture
def recv_frames() -> Callable[..., list[zmq.Frame]]:
    return _recv_frames


# -- control hub -----------------------------------------------------------------------------------


class RunningHub:
    """A :class:`bus.hub.ControlHub` forwarding in a thread, with the two endpoints it bound
    (``tcp://127.0.0.1:*`` binds a random port; the attributes give the real one)."""

    def __init__(self, ctx: zmq.Context, pub_endpoint: str, sub_endpoint: str, **hub_kw: Any) -> None:
        self.stop = threading.Event()
        self.hub = ControlHub(ctx, pub_endpoint, sub_endpoint, self.stop, **hub_kw)
        self.pub_endpoint = self.hub.inbound.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sub_endpoint = self.hub.outbound.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.thread = threading.Thread(target=self.hub.run, name="control-hub", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive(), "hub did not stop within 5 s"
        self.hub.inbound.sock.close(linger=0)
        self.hub.outbound.sock.close(linger=0)


@pytest.fixture
def make_hub():
    """Factory of :class:`RunningHub` (ctx, pub_endpoint, sub_endpoint, keyword arguments of
    :class:`bus.hub.ControlHub`); stops them all at teardown."""
    hubs: list[RunningHub] = []

    def make(ctx: zmq.Context, pub_endpoint: str, sub_endpoint: str, **hub_kw: Any) -> RunningHub:
        hubs.append(RunningHub(ctx, pub_endpoint, sub_endpoint, **hub_kw))
        return hubs[-1]

    yield make
    for running in hubs:
        running.close()


@pytest.fixture
def hub(ctx, endpoint, make_hub):
    return make_hub(ctx, endpoint("control_pub"), endpoint("control_sub"))


def _sync_control(publish: Callable[[int], None], sub_recv: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Slow-joiner sync (zguide ``syncpub``): publish probes until the subscriber sees one.

    ``publish(n)`` sends probe ``n``; ``sub_recv()`` returns a received probe or None (short wait).
    Leftover probes are drained so the test starts from an empty subscriber.
    """
    deadline = time.monotonic() + timeout_s
    n = 0
    while time.monotonic() < deadline:
        publish(n)
        n += 1
        if sub_recv() is not None:
            while sub_recv() is not None:
                pass
            return
    pytest.fail(f"control channel not connected within {timeout_s} s")


@pytest.fixture
def sync_control() -> Callable[..., None]:
    return _sync_control
