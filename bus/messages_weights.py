"""Weight messages: the torch.distributed weight group's re-formation (:class:`WeightGroup`, its ack) and
the ``weights`` topic of ``broadcast.method: bus`` (:class:`WeightsRequest`, :class:`WeightsBucket`). When a
producer joins late or a member dies the trainer re-forms the group at a version boundary (docs/ARCHITECTURE.md,
"Weights"). ``check`` invariants: a generation numbers one trainer process's re-formations (0: the group formed
at start); ``members`` and ``filesystem`` are disjoint, without duplicates; world size ``1 + len(members)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bus.messages import Message
from bus.wire import WireError, array_field


@dataclass(frozen=True, eq=False)
class WeightGroup(Message):
    """The trainer re-forms the weight-broadcast group (control channel): rendezvous ``host:port`` (the
    trainer's store, rank 0); ``members[i]`` joins as rank ``i + 1``; ``filesystem``: producers left out of
    a timed-out re-form, on the filesystem method from now on."""

    TYPE: ClassVar[str] = "weights.group"
    generation: int
    host: str
    port: int
    members: list[str]
    filesystem: list[str]

    @property
    def world_size(self) -> int:
        """1 (the trainer) + members."""
        return 1 + len(self.members)

    def rank_of(self, producer: str) -> int | None:
        """The rank `producer` joins as, or None if it is not a member."""
        return self.members.index(producer) + 1 if producer in self.members else None

    def check(self) -> None:
        if self.generation < 0:
            raise WireError("inconsistent", f"generation must be >= 0, got {self.generation}")
        if not 0 < self.port < 65536:
            raise WireError("inconsistent", f"port must be in 1..65535, got {self.port}")
        names = [*self.members, *self.filesystem]
        if len(set(names)) != len(names):
            raise WireError("inconsistent", "members and filesystem must be disjoint, without duplicates")


@dataclass(frozen=True, eq=False)
class WeightGroupAck(Message):
    """``producer`` is joining ``WeightGroup`` ``generation`` (a member that never acks is blamed)."""

    TYPE: ClassVar[str] = "weights.group_ack"
    producer: str
    generation: int

    def check(self) -> None:
        if self.generation < 0:
            raise WireError("inconsistent", f"generation must be >= 0, got {self.generation}")


WEIGHT_GROUP_TYPES: tuple[type[Message], ...] = (WeightGroup, WeightGroupAck)  # control channel
MAX_REQUESTED_BUCKETS = 64  # most bucket indices one WeightsRequest may name


@dataclass(frozen=True, eq=False)
class WeightsRequest(Message):
    """A producer's worker asks for ``buckets`` (``[k]`` indices >= 0) of the ``version`` it assembles
    (``weights`` topic, DEALER -> ROUTER); the answer is one :class:`WeightsBucket` per index of the
    trainer's latest version, so it never queues more than asked (:mod:`broadcaster.bus_method`)."""

    TYPE: ClassVar[str] = "weights.request"
    producer: str
    version: int
    buckets: list

    def check(self) -> None:
        if self.version < 0:
            raise WireError("inconsistent", f"version must be >= 0, got {self.version}")
        if len(self.buckets) > MAX_REQUESTED_BUCKETS or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.buckets
        ):
            raise WireError("inconsistent", f"buckets must be at most {MAX_REQUESTED_BUCKETS} indices >= 0")


@dataclass(frozen=True, eq=False)
class WeightsBucket(Message):
    """Bucket ``index`` of ``num_buckets`` of policy ``version`` (trainer -> worker, ``weights`` topic), in the
    plan of :func:`broadcaster.manifest.plan_buckets` with ``bucket_bytes``. ``data``: ``[nbytes] uint8``, the
    flat buffer in its wire dtype (bfloat16 as bytes); ``crc32``: ``zlib.crc32`` of it (damaged: asked again)."""

    TYPE: ClassVar[str] = "weights.bucket"
    version: int
    index: int
    num_buckets: int
    bucket_bytes: int
    crc32: int
    data: np.ndarray = array_field("uint8")

    def check(self) -> None:
        if self.version < 0 or not 0 <= self.index < self.num_buckets or self.bucket_bytes <= 0:
            raise WireError(
                "inconsistent",
                f"bucket {self.index} of {self.num_buckets} (version {self.version}, "
                f"bucket_bytes {self.bucket_bytes}) is out of range",
            )
        if not 0 <= self.crc32 < 2**32:
            raise WireError("inconsistent", f"crc32 must be a 32-bit unsigned value, got {self.crc32}")


WEIGHT_TRANSFER_TYPES: tuple[type[Message], ...] = (WeightsRequest, WeightsBucket)  # the weights topic only
