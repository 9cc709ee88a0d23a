"""Which node each component runs on, and the bus addresses that follow (pure functions).

An :class:`Allocation` is the nodes of a Slurm job: one group for a plain job, or the three
components of the heterogeneous job ``busctl sbatch`` writes (0: inference nodes, 1: trainer
nodes, 2: CPU nodes). :func:`plan_nodes` places every role:

- heterogeneous: producer ``i`` on inference node ``i mod n``; the trainer on the first trainer
  node; hub, packer and prompt source on the first CPU node; reward worker ``i`` on CPU node
  ``i mod n``.
- plain, one node: everything on it.
- plain, ``N >= 2`` nodes: trainer, hub, packer and prompt source on the first node; producer
  ``i`` on node ``1 + i mod (N - 1)``; reward worker ``i`` on node ``i mod N``.

GPU roles (trainer, producers) get on their node the devices :mod:`busctl.placement` plans per
host. :func:`address_map` then names, for ``bus.hosts``, the host of the side that binds each
endpoint (:mod:`bus.topics`): the hub binds control, the prompt source prompts and outcomes, the
packer scored and batches, the trainer weights (``broadcast.method: bus``), producer ``i``
``rollouts-i``, busctl the supervisor socket.
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
    """A component's node is gone and the run cannot go on there (the message names the node and
    why: the allocation ended, or no live node of the allocation is left for the component); the
    supervisor fails the run with it (raised by a launcher's ``check_crash``, e.g. slurm's)."""


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
    """The :class:`Slot` of component ``role`` replica ``index`` (rules: the module docstring).

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
    """``bus.hosts`` of a run on ``alloc``: endpoint key -> address of the node that binds it.

    Args:
        alloc: the job's nodes. max_producers: ``producers.max_replicas`` (every index that
            ``busctl scale`` may add gets its ``rollouts-I``). supervisor_host: where busctl runs.
        resolve: node name -> address (e.g. ``socket.gethostbyname``).
    """
    hosts = {key: resolve(plan_nodes(alloc, role).node) for key, role in BINDERS.items()}
    hosts.update({f"rollouts-{i}": resolve(plan_nodes(alloc, "producer", i).node) for i in range(max_producers)})
    hosts["supervisor"] = resolve(supervisor_host)
    return hosts
