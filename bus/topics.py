"""The topic and endpoint table: who binds, socket types, bounds, ports (who connects where:
docs/ARCHITECTURE.md, "Processes and topics"). Data topics (``reliable``) are ROUTER/DEALER with custody and
credit (:mod:`bus.courier`); their small bounds make the trainer's pace reach the prompt source (no
unbounded queue) and ``bus.max_inflight_bytes`` bounds them in bytes. ``weights`` is request/reply of weight
buckets, not custody. Reward workers connect to all ``producers.max_replicas`` rollouts endpoints, so
scaled-up producers are reached without a restart. The names live in :mod:`configs.topic_names` (zmq-free,
for the config's checks); :data:`TOPICS` names exactly those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from configs.bus_limits import DATA_TOPIC_NAMES
from configs.topic_names import TOPIC_NAMES

IPC_PATH_MAX = 100  # longest ipc:// socket path used (the kernel's sun_path holds 107 bytes)


@dataclass(frozen=True)
class TopicSpec:
    """One topic: socket types of each side, ``hwm`` (a data topic's credit and outbox bound, messages),
    whether a sender ``blocks`` at it (else drops), its tcp ``port_offset``, ``reliable`` (a data topic)."""

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
        TopicSpec("api", zmq.ROUTER, zmq.DEALER, hwm=10_000, blocks=False, port_offset=8),
        TopicSpec("samplers", zmq.ROUTER, zmq.DEALER, hwm=10_000, blocks=False, port_offset=80),
    )
}
assert tuple(TOPICS) == TOPIC_NAMES, "configs.topic_names.TOPIC_NAMES must name every topic of TOPICS, in order"
assert set(DATA_TOPIC_NAMES) == {t for t, s in TOPICS.items() if s.reliable}, (
    "configs.bus_limits.DATA_TOPIC_NAMES must name every data topic"
)


def socket_dir(run_dir: Path) -> Path:
    """``run_dir/sock``, or ``/tmp/rlbus-<hash>`` when that would exceed :data:`IPC_PATH_MAX`."""
    run_dir = Path(run_dir).resolve()
    candidate = run_dir / "sock"
    if len(str(candidate)) + 24 <= IPC_PATH_MAX:
        return candidate
    return Path("/tmp") / ("rlbus-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:12])


@dataclass(frozen=True)
class Endpoints:
    """Topic names -> endpoints of one run: ipc files in :func:`socket_dir`, or
    ``tcp://HOST:base_port + port_offset (+ producer index)``, HOST from ``hosts`` (``bus.hosts``, by topic
    or ``rollouts-I``) else ``host``.

    Raises:
        ValueError: a transport other than ``ipc`` or ``tcp``.
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
        """Endpoint of ``topic`` (``index``: a producer's ``rollouts``); ValueError: unknown topic, bad index."""
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
