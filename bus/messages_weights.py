"""Weight messages beside `bus.messages`: the torch.distributed weight group's membership (issue
16: groups that re-form) and the `weights` topic of `broadcast.method: bus` (issue 17).

The broadcast weight group (`broadcaster.dist_broadcast`) has a fixed world size once formed. When a
producer joins (restart, late join, `busctl scale`) or a member dies, the trainer re-forms it: it
announces `WeightGroup` (a new rendezvous and the new membership) at a version boundary, every
listed producer acknowledges with `WeightGroupAck`, leaves its old group and joins the new one.
The trainer learns who joined late from `bus.messages.WeightsWanted` (a producer outside the group).

Invariants (checked by `check`, raising `WireError("inconsistent")`):
- a generation numbers re-formations of one trainer process: 0 is the group formed at start,
  each re-formation takes the next one;
- `members` and `filesystem` are disjoint and hold no duplicates; member `i` is rank `i + 1`
  (the trainer is rank 0), so the world size is `1 + len(members)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bus.messages import Message
from bus.wire import WireError, array_field


@dataclass(frozen=True, eq=False)
class WeightGroup(Message):
    """The trainer re-forms the weight-broadcast group (trainer -> producers, control channel).

    Fields:
        generation: the group's number (> 0 for a re-formed group; see the module docstring).
        host, port: the new rendezvous (the trainer hosts the store there as rank 0).
        members: producer names in rank order: `members[i]` joins as rank `i + 1`.
        filesystem: producers that take weights by the filesystem method from now on (a re-form
            that timed out without them); they leave any old group.
    """

    TYPE: ClassVar[str] = "weights.group"
    generation: int
    host: str
    port: int
    members: list[str]
    filesystem: list[str]

    @property
    def world_size(self) -> int:
        """1 (the trainer) + the number of members."""
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
    """Producer `producer` got `WeightGroup` `generation` and is joining it (producer -> trainer,
    control channel). A member that never acknowledges is the one a timed-out re-form blames."""

    TYPE: ClassVar[str] = "weights.group_ack"
    producer: str
    generation: int

    def check(self) -> None:
        if self.generation < 0:
            raise WireError("inconsistent", f"generation must be >= 0, got {self.generation}")


WEIGHT_GROUP_TYPES: tuple[type[Message], ...] = (WeightGroup, WeightGroupAck)
"""The control-channel message types of this module (see `bus.registry`)."""

MAX_REQUESTED_BUCKETS = 64
"""Most bucket indices one `WeightsRequest` may name (the receivers ask for a small window)."""


@dataclass(frozen=True, eq=False)
class WeightsRequest(Message):
    """A producer's vLLM worker asks for buckets of a weight version (producer -> trainer, `weights`
    topic, DEALER -> ROUTER; `broadcaster.bus_method`). Pull-based: the trainer answers each
    request with one `WeightsBucket` per index, of its LATEST version (which may be newer than
    `version`), so it never queues more than a receiver asked for.

    Fields:
        producer: the asking producer's name (logs only).
        version: the version the receiver is assembling (the announcement's, or a newer one it
            was given instead).
        buckets: `[k]` bucket indices wanted (0 <= index, at most `MAX_REQUESTED_BUCKETS`).
    """

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
    """One bucket of one weight version (trainer -> one producer's worker, `weights` topic, the
    answer to a `WeightsRequest`; `broadcaster.bus_method`).

    Fields:
        version: the policy version this bucket belongs to (the trainer's latest).
        index: the bucket's position in the plan (`broadcaster.manifest.plan_buckets` of the
            announced manifest and `bucket_bytes`), `0 <= index < num_buckets`.
        num_buckets: how many buckets the version has.
        bucket_bytes: the bucket size the plan was made with, bytes.
        crc32: `zlib.crc32` of `data`: a frame damaged on the way is dropped and asked again.
        data: `[nbytes] uint8` the bucket's flat buffer, raw bytes in its wire dtype (bfloat16
            travels as bytes: the bus carries no bfloat16 arrays), sent zero-copy from the
            trainer's send buffer.
    """

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


WEIGHT_TRANSFER_TYPES: tuple[type[Message], ...] = (WeightsRequest, WeightsBucket)
"""The `weights` topic's message types (never on the control channel; see `bus.registry`)."""
