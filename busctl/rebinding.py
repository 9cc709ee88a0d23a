"""A binding component restarted on a node with another address: new ``bus.hosts``, and who restarts.

Launchers keep a restarted component on its node while that node lives; only when it died may a binder land at
another address, where its peers (connected to the old one) would never find it. Before the binder's spawn,
:func:`plan_move` (pure) says what changes: ``bus.hosts`` (and ``broadcast.host`` for the trainer) at the new
address, the components that connect to its endpoints (:data:`CONNECTORS`; restarted after the spawn) and
whether busctl's control subscription must reconnect; :func:`apply_move` writes it into ``config.yaml``.
Nothing is lost: each restart is a crash-restart of that role under custody (docs/ARCHITECTURE.md,
"Lifecycle and healing"), counted against ``supervisor.max_restarts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from busctl.components.table import ComponentSpec
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
    """What follows from a binder's move.

    Attributes:
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
    """The ``bus.hosts`` keys a component of ``role`` (replica ``index``) binds (:data:`BINDERS`, plus a producer's
    ``rollouts-I``); () for reward workers."""
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
    """What changes when component ``name`` (``role``, replica ``index``) is about to start at ``address`` (``""``:
    not placed by address), given ``bus.hosts`` now and ``table``'s ``(name, role)`` rows in order; None when
    nothing moves (a key missing from ``hosts`` is a single-host run)."""
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
    """:func:`plan_move` for ``spec`` about to start at ``address``, then :func:`apply_move`; None: nothing moves."""
    move = plan_move(cfg.bus.hosts, spec.name, spec.role, spec.index, address, [(s.name, s.role) for s in table])
    if move is not None:
        apply_move(cfg, move, run_dir)
    return move


def apply_move(cfg: RunConfig, move: Move, run_dir: Path) -> None:
    """Write ``move`` into ``cfg`` and ``RUN_DIR/config.yaml``, which every later spawn reads."""
    cfg.bus.hosts = dict(move.hosts)
    if move.broadcast_host is not None:
        cfg.broadcast.host = move.broadcast_host
    (Path(run_dir) / "config.yaml").write_text(dump_config(cfg))
