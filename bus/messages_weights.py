"""Control messages of the torch.distributed weight group's membership (issue 16: groups that re-form).

The broadcast weight group (`broadcaster.broadcast`) has a fixed world size once formed. When a
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

from bus.messages import Message
from bus.wire import WireError


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
"""The message types of this module (all on the control channel; see `bus.registry`)."""
