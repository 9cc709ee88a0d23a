"""The topic and endpoint table of rlbus: who binds, who connects, socket types and bounds.

Data topics carry at-least-once delivery with custody (:mod:`bus.courier`): the side that binds
is a ROUTER, the side that connects one DEALER per endpoint; credit bounds what waits anywhere:

| topic      | binder (socket)                      | connectors (socket)                     | bound (credit / outbox)  |
|------------|--------------------------------------|-----------------------------------------|--------------------------|
| prompts    | prompt source, sender (ROUTER)       | every producer, receiver (DEALER)       | 4                        |
| rollouts/i | producer i, sender (ROUTER), one each| every reward worker, receiver (DEALER)  | 8                        |
| scored     | packer, receiver (ROUTER)            | every reward worker, sender (DEALER)    | 8                        |
| batches    | packer, sender (ROUTER)              | trainer, receiver (DEALER)              | 2                        |
| outcomes   | prompt source, receiver (ROUTER)     | trainer, packer, producers (DEALER)     | 64                       |
| control    | hub XSUB (pub side), XPUB (sub)      | everyone PUB / SUB                      | PUB drops (never blocks) |
| supervisor | busctl (PULL)                        | every component (PUSH)                  | blocks (tiny traffic)    |
| weights    | trainer (ROUTER), `broadcast.method: | every producer's vLLM worker (DEALER)   | 8 per peer; ROUTER drops |
|            | bus` or its fallback                 |                                         | at it, the worker re-asks|

``outcomes`` carries ``groups.trained`` / ``groups.dropped`` to the prompt source's ledger, so no
outcome is lost while the prompt source restarts (they are also published on the control channel
for observers). The bound is the credit a receiver grants each sender and the number of messages a sender's
outbox holds before ``send`` blocks; small bounds on ``batches`` and ``scored`` make the trainer's
pace propagate back to the prompt source (invariant 1: no unbounded queue). They count messages;
``bus.max_inflight_bytes`` (:mod:`configs.bus_limits`) bounds the same windows in bytes. ``weights`` (:mod:`broadcaster.bus_method`) is request/reply, not custody: a worker asks
for a window of buckets of a version and the trainer answers with its latest version's buckets,
so nothing waits anywhere but what a receiver asked for. Reward workers connect to ``producers.max_replicas`` rollouts endpoints, so
producers added by ``busctl scale`` are reached without a restart.

Endpoints are ``ipc://`` files under the run's socket directory by default, or ``tcp://host:port``
with ports at fixed offsets from ``bus.base_port``. On several hosts (``busctl up --launcher
slurm``) ``bus.hosts`` names the host of the side that binds each endpoint (key: the topic, or
``rollouts-I`` for producer I); both the binder and its connectors use that address.

The topic names themselves live in :mod:`configs.topic_names` (zmq-free), so that the config
checks the keys of ``bus.hosts`` without importing the bus; :data:`TOPICS` names exactly those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from configs.bus_limits import DATA_TOPIC_NAMES
from configs.topic_names import TOPIC_NAMES

IPC_PATH_MAX = 100
"""Longest ipc:// socket path used (the kernel limit of sun_path is 107 bytes)."""


@dataclass(frozen=True)
class TopicSpec:
    """Static description of one topic.

    Attributes:
        name: topic name (also the metrics label).
        send_type / recv_type: ZeroMQ socket types of the sending and the receiving side.
        hwm: high-water mark (messages); on a data topic the credit and outbox bound instead.
        blocks: True if a sender blocks at the HWM; False if messages are dropped (PUB).
        port_offset: offset from ``bus.base_port`` for tcp:// (producers add their index).
        reliable: a data topic with at-least-once delivery (:mod:`bus.courier`).
    """

    name: str
    send_type: int
    recv_type: int
    hwm: int
    blocks: bool
    port_offset: int
    reliable: bool = False


TOPICS: dict[str, TopicSpec] = {
    t.name: t
    for t in (
        TopicSpec("prompts", zmq.ROUTER, zmq.DEALER, hwm=4, blocks=True, port_offset=0, reliable=True),
        TopicSpec("scored", zmq.DEALER, zmq.ROUTER, hwm=8, blocks=True, port_offset=1, reliable=True),
        TopicSpec("batches", zmq.ROUTER, zmq.DEALER, hwm=2, blocks=True, port_offset=2, reliable=True),
        TopicSpec("outcomes", zmq.DEALER, zmq.ROUTER, hwm=64, blocks=True, port_offset=6, reliable=True),
        TopicSpec("control_pub", zmq.PUB, zmq.XSUB, hwm=10_000, blocks=False, port_offset=3),
        TopicSpec("control_sub", zmq.XPUB, zmq.SUB, hwm=10_000, blocks=False, port_offset=4),
        TopicSpec("supervisor", zmq.PUSH, zmq.PULL, hwm=1000, blocks=True, port_offset=5),
        TopicSpec("weights", zmq.ROUTER, zmq.DEALER, hwm=8, blocks=False, port_offset=9),
        TopicSpec("rollouts", zmq.ROUTER, zmq.DEALER, hwm=8, blocks=True, port_offset=10, reliable=True),
    )
}
assert tuple(TOPICS) == TOPIC_NAMES, "configs.topic_names.TOPIC_NAMES must name every topic of TOPICS, in order"
assert set(DATA_TOPIC_NAMES) == {t for t, s in TOPICS.items() if s.reliable}, (
    "configs.bus_limits.DATA_TOPIC_NAMES must name every data topic"
)


def socket_dir(run_dir: Path) -> Path:
    """Directory of the run's ipc:// sockets: ``run_dir/sock``, or a short path under /tmp
    derived from a hash of ``run_dir`` when that would exceed :data:`IPC_PATH_MAX`."""
    run_dir = Path(run_dir).resolve()
    candidate = run_dir / "sock"
    if len(str(candidate)) + 24 <= IPC_PATH_MAX:
        return candidate
    return Path("/tmp") / ("rlbus-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:12])


@dataclass(frozen=True)
class Endpoints:
    """Resolves topic names to ZeroMQ endpoint strings for one run.

    Attributes:
        transport: ``"ipc"`` or ``"tcp"``.
        run_dir: the run directory (ipc sockets live in :func:`socket_dir` of it).
        host: tcp host (bind and connect address), e.g. ``"127.0.0.1"``.
        base_port: first tcp port; topics use ``base_port + TopicSpec.port_offset (+ index)``.
        hosts: per-endpoint tcp host of the binder (``bus.hosts``: key ``topic`` or
            ``rollouts-I``); an endpoint not in it uses ``host``.
    """

    transport: str
    run_dir: Path
    host: str = "127.0.0.1"
    base_port: int = 5550
    hosts: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"bus.transport must be 'ipc' or 'tcp', got {self.transport!r}")

    def address(self, topic: str, index: int = 0) -> str:
        """Endpoint of ``topic``; ``index`` selects a producer's own ``rollouts`` endpoint.

        Raises:
            ValueError: unknown topic, or an index given for a topic that has only one endpoint.
        """
        spec = TOPICS.get(topic)
        if spec is None:
            raise ValueError(f"unknown topic {topic!r}; known: {sorted(TOPICS)}")
        if index and topic != "rollouts":
            raise ValueError(f"topic {topic!r} has a single endpoint; index must be 0")
        name = f"{topic}-{index}" if topic == "rollouts" else topic
        if self.transport == "tcp":
            return f"tcp://{self.hosts.get(name, self.host)}:{self.base_port + spec.port_offset + index}"
        return f"ipc://{socket_dir(self.run_dir) / name}"

    def ensure_dirs(self) -> None:
        """Create the ipc socket directory (no-op for tcp)."""
        if self.transport == "ipc":
            socket_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
