"""A binding component restarted on a node with another address: new ``bus.hosts``, and who restarts.

On several nodes every endpoint is ``tcp://ADDRESS:PORT`` with ADDRESS the node of the side that
binds it (``bus.hosts``, :func:`busctl.launchers.nodes.address_map`). Launchers keep a restarted
component on its node while that node lives (the Slurm allocation is fixed; the Ray launcher pins
each component to its node, :meth:`busctl.launchers.ray.RayLauncher.place`), so its address never
changes then. Only when the node died does a binder land on another node, whose address may differ;
then its peers, which connected to the old address, would never find it. :func:`plan_move` says
what must change, before the binder is spawned:

- ``hosts``: ``bus.hosts`` with the binder's endpoints (:func:`bound_keys`) at the new address
  (and ``broadcast.host`` when the trainer moves: the weight broadcast meets at its node);
- ``restart``: every other component that connects to one of those endpoints
  (:data:`CONNECTORS`, the connect side of the table in :mod:`bus.topics`): its sockets hold the
  old address, so the supervisor restarts it after the binder's spawn, with the rewritten
  ``config.yaml``;
- ``control_moved``: the hub moved, so busctl's own control subscription reconnects too.

Restarting a connector loses nothing: data topics are at-least-once with custody
(:mod:`bus.courier`): what a sender had not yet seen acknowledged is resent by its successor from
the durable state (prompt ledger, packer spool, trainer checkpoint), what a receiver held unacked
is redelivered by the binder, and duplicates are dropped by id (the same path as any crash-restart
of that role). Each such restart counts against ``supervisor.max_restarts`` of the restarted
component.

Invariant: ``plan_move`` is pure (no I/O): :func:`apply_move` writes the result into the config
(:func:`rebind`: both, as the supervisor calls them before each spawn).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from busctl.component_table import ComponentSpec
from busctl.launchers.nodes import BINDERS
from configs.schema import RunConfig, dump_config

CONNECTORS: dict[str, frozenset[str]] = {
    "control_pub": frozenset({"trainer", "packer", "rewards", "producer", "prompt-source"}),
    "control_sub": frozenset({"trainer", "packer", "rewards", "producer", "prompt-source"}),
    "prompts": frozenset({"producer"}),
    "outcomes": frozenset({"trainer", "packer", "producer"}),
    "scored": frozenset({"rewards"}),
    "batches": frozenset({"trainer"}),
    "rollouts": frozenset({"rewards"}),
    "weights": frozenset({"producer"}),
}
"""Endpoint (``rollouts`` for every ``rollouts-I``) -> the roles that connect to it (:mod:`bus.topics`)."""


@dataclass(frozen=True)
class Move:
    """What follows from a binder's move (module docstring).

    Attributes:
        binder: the component that moves. address: its new node's address.
        keys: the ``bus.hosts`` keys it binds. hosts: the new ``bus.hosts``.
        broadcast_host: the new ``broadcast.host`` (the trainer moved), else None.
        restart: names of the components to restart (table order). control_moved: the hub moved.
    """

    binder: str
    address: str
    keys: tuple[str, ...]
    hosts: dict[str, str]
    broadcast_host: str | None
    restart: tuple[str, ...]
    control_moved: bool


def bound_keys(role: str, index: int = 0) -> tuple[str, ...]:
    """The ``bus.hosts`` keys a component of ``role`` (replica ``index``) binds
    (:data:`busctl.launchers.nodes.BINDERS`, the trainer's ``weights`` among them, plus a
    producer's ``rollouts-I``); () for a role that binds nothing (reward workers)."""
    if role == "producer":
        return (f"rollouts-{index}",)
    return tuple(key for key, binder in BINDERS.items() if binder == role)


def connector_roles(key: str) -> frozenset[str]:
    """The roles that connect to endpoint ``key`` (``rollouts-I`` counts as ``rollouts``).

    Raises:
        ValueError: an unknown key.
    """
    base = "rollouts" if key.startswith("rollouts-") and key[len("rollouts-") :].isdigit() else key
    if base not in CONNECTORS:
        raise ValueError(f"unknown endpoint key {key!r}; known: {sorted(CONNECTORS)} and rollouts-I")
    return CONNECTORS[base]


def plan_move(
    hosts: Mapping[str, str], name: str, role: str, index: int, address: str, table: Iterable[tuple[str, str]]
) -> Move | None:
    """What changes when component ``name`` (``role``, replica ``index``) is about to start on a
    node at ``address``.

    Args:
        hosts: the run's ``bus.hosts`` now. address: the node's address (``""``: the launcher
            does not place by address, e.g. local: nothing moves).
        table: ``(name, role)`` of every component of the run, in table order.

    Returns:
        None when nothing moves (no address, a role that binds nothing, or every endpoint it
        binds already at ``address``; a key missing from ``hosts`` is a single-host run: never a
        move), else the :class:`Move`.
    """
    keys = tuple(k for k in bound_keys(role, index) if k in hosts)
    if not address or not keys or all(hosts[k] == address for k in keys):
        return None
    roles = frozenset().union(*(connector_roles(k) for k in keys))
    restart = tuple(n for n, r in table if r in roles and n != name)
    return Move(
        binder=name,
        address=address,
        keys=keys,
        hosts={**hosts, **{k: address for k in keys}},
        broadcast_host=address if role == "trainer" else None,
        restart=restart,
        control_moved=any(k.startswith("control") for k in keys),
    )


def rebind(
    cfg: RunConfig, run_dir: Path, spec: ComponentSpec, address: str, table: Iterable[ComponentSpec]
) -> Move | None:
    """:func:`plan_move` for ``spec`` about to start at ``address`` among ``table``, and
    :func:`apply_move` of the result; None when nothing moves."""
    move = plan_move(cfg.bus.hosts, spec.name, spec.role, spec.index, address, [(s.name, s.role) for s in table])
    if move is not None:
        apply_move(cfg, move, run_dir)
    return move


def apply_move(cfg: RunConfig, move: Move, run_dir: Path) -> None:
    """Write ``move`` into ``cfg`` (``bus.hosts``, ``broadcast.host``) and rewrite
    ``RUN_DIR/config.yaml``, which every later spawn reads (the Ray launcher sends it to the node)."""
    cfg.bus.hosts = dict(move.hosts)
    if move.broadcast_host is not None:
        cfg.broadcast.host = move.broadcast_host
    (Path(run_dir) / "config.yaml").write_text(dump_config(cfg))
