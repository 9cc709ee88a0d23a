"""Which node each component runs on, and the bus addresses that follow (pure functions).

An :class:`Allocation` is the nodes of a job: one group, or the three of a heterogeneous ``busctl sbatch`` job
(inference, trainer, CPU). :func:`plan_nodes` places every role; :func:`address_map` names, for ``bus.hosts``,
the node of the side that binds each endpoint (:data:`BINDERS`). GPU roles get on their node the devices
:mod:`busctl.components.placement` plans per host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

HET_GROUPS = ("inference", "trainer", "cpu")
"""The het-job components ``busctl sbatch`` writes, in order (het group 0, 1, 2)."""

BINDERS = {
    "control_pub": "hub",
    "control_sub": "hub",
    "prompts": "prompt-source",
    "outcomes": "prompt-source",
    "scored": "packer",
    "batches": "packer",
    "weights": "trainer",
}
"""Endpoint -> the role that binds it (besides ``rollouts-I``: producer I; ``supervisor``: busctl)."""


class NodeLost(RuntimeError):
    """A component's node is gone and the run cannot go on (the allocation ended, or no live node is left for it);
    the message names the node. Raised by a launcher's ``check_crash``; the supervisor fails the run with it."""


@dataclass(frozen=True)
class Slot:
    """Where one component runs: ``node`` (host name), in het-job component ``het_group`` (None: plain job)."""

    node: str
    het_group: int | None = None


@dataclass(frozen=True)
class Allocation:
    """The nodes of a job: ``groups[k]`` the nodes of het group k (a plain job: one group)."""

    groups: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not self.groups or any(not g for g in self.groups):
            raise ValueError(f"an allocation needs at least one node in every group, got {self.groups}")
        if len(self.groups) not in (1, len(HET_GROUPS)):
            raise ValueError(
                f"a heterogeneous job needs {len(HET_GROUPS)} components ({', '.join(HET_GROUPS)}), "
                f"got {len(self.groups)}"
            )

    @property
    def heterogeneous(self) -> bool:
        """Whether the job has inference, trainer and CPU components."""
        return len(self.groups) > 1


def plan_nodes(alloc: Allocation, role: str, index: int = 0) -> Slot:
    """The :class:`Slot` of component ``role`` replica ``index``.

    Heterogeneous: producer ``i`` on inference node ``i mod n``, the trainer on the first trainer node, hub, packer
    and prompt source on the first CPU node, reward worker ``i`` on CPU node ``i mod n``. Plain: one node holds
    everything; with ``N >= 2``, trainer, hub, packer and prompt source on the first, producer ``i`` on node
    ``1 + i mod (N - 1)``, reward worker ``i`` on node ``i mod N``.

    Raises:
        ValueError: a negative index.
    """
    if index < 0:
        raise ValueError(f"replica index must be >= 0, got {index}")
    if alloc.heterogeneous:
        inference, trainer, cpu = alloc.groups
        if role == "producer":
            return Slot(inference[index % len(inference)], 0)
        if role == "trainer":
            return Slot(trainer[0], 1)
        if role == "rewards":
            return Slot(cpu[index % len(cpu)], 2)
        return Slot(cpu[0], 2)
    nodes = alloc.groups[0]
    if len(nodes) == 1:
        return Slot(nodes[0])
    if role == "producer":
        return Slot(nodes[1 + index % (len(nodes) - 1)])
    if role == "rewards":
        return Slot(nodes[index % len(nodes)])
    return Slot(nodes[0])


def address_map(
    alloc: Allocation, max_producers: int, supervisor_host: str, resolve: Callable[[str], str] = lambda node: node
) -> dict[str, str]:
    """``bus.hosts`` of a run on ``alloc``: endpoint key -> address (``resolve(node)``) of the node that binds it,
    with a ``rollouts-I`` for every producer index up to ``max_producers`` and busctl's ``supervisor``."""
    hosts = {key: resolve(plan_nodes(alloc, role).node) for key, role in BINDERS.items()}
    hosts.update({f"rollouts-{i}": resolve(plan_nodes(alloc, "producer", i).node) for i in range(max_producers)})
    hosts["supervisor"] = resolve(supervisor_host)
    return hosts
