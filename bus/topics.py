"""The topic and endpoint table of rlbus: who binds, who connects, socket types and HWMs.

Data flows PUSH -> PULL; ZeroMQ load-balances a PUSH over its connected PULL peers and
fair-queues a PULL over its connected PUSH peers, so each topic has one fixed binder:

| topic      | binder (socket)                 | connectors (socket)         | HWM at full                |
|------------|---------------------------------|-----------------------------|----------------------------|
| prompts    | prompt source (PUSH)            | every producer (PULL)       | blocks the prompt source   |
| rollouts/i | producer i (PUSH), one per prod | every reward worker (PULL)  | blocks producer i          |
| scored     | packer (PULL)                   | every reward worker (PUSH)  | blocks the reward worker   |
| batches    | packer (PUSH)                   | trainer (PULL)              | blocks the packer          |
| control    | hub XSUB (pub side), XPUB (sub) | everyone PUB / SUB          | PUB drops (never blocks)   |
| supervisor | busctl (PULL)                   | every component (PUSH)      | blocks (tiny traffic)      |

Small HWMs on ``batches`` and ``scored`` make the trainer's pace propagate back to the prompt
source (invariant 1: no unbounded queue). HWMs count messages, not bytes.

Endpoints are ``ipc://`` files under the run's socket directory by default, or ``tcp://host:port``
with ports at fixed offsets from ``bus.base_port``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import zmq

IPC_PATH_MAX = 100
"""Longest ipc:// socket path used (the kernel limit of sun_path is 107 bytes)."""


@dataclass(frozen=True)
class TopicSpec:
    """Static description of one topic.

    Attributes:
        name: topic name (also the metrics label).
        send_type / recv_type: ZeroMQ socket types of the sending and the receiving side.
        hwm: high-water mark (messages) set on both sides.
        blocks: True if a sender blocks at the HWM; False if messages are dropped (PUB).
        port_offset: offset from ``bus.base_port`` for tcp:// (producers add their index).
    """

    name: str
    send_type: int
    recv_type: int
    hwm: int
    blocks: bool
    port_offset: int


TOPICS: dict[str, TopicSpec] = {
    t.name: t
    for t in (
        TopicSpec("prompts", zmq.PUSH, zmq.PULL, hwm=4, blocks=True, port_offset=0),
        TopicSpec("scored", zmq.PUSH, zmq.PULL, hwm=8, blocks=True, port_offset=1),
        TopicSpec("batches", zmq.PUSH, zmq.PULL, hwm=2, blocks=True, port_offset=2),
        TopicSpec("control_pub", zmq.PUB, zmq.XSUB, hwm=10_000, blocks=False, port_offset=3),
        TopicSpec("control_sub", zmq.XPUB, zmq.SUB, hwm=10_000, blocks=False, port_offset=4),
        TopicSpec("supervisor", zmq.PUSH, zmq.PULL, hwm=1000, blocks=True, port_offset=5),
        TopicSpec("rollouts", zmq.PUSH, zmq.PULL, hwm=8, blocks=True, port_offset=10),
    )
}


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
    """

    transport: str
    run_dir: Path
    host: str = "127.0.0.1"
    base_port: int = 5550

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
        if self.transport == "tcp":
            return f"tcp://{self.host}:{self.base_port + spec.port_offset + index}"
        name = f"{topic}-{index}" if topic == "rollouts" else topic
        return f"ipc://{socket_dir(self.run_dir) / name}"

    def ensure_dirs(self) -> None:
        """Create the ipc socket directory (no-op for tcp)."""
        if self.transport == "ipc":
            socket_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
