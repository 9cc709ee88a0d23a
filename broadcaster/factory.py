"""The one place that turns `broadcast.method` (configs/schema.py `BroadcastConfig`) into weight
senders and receivers: every other module works with `broadcaster.base.WeightSender` /
`WeightReceiver` objects and never compares method names.

    broadcast.method   trainer (build_senders)                 producer (build_receiver)
    "broadcast"        BroadcastSender, the fallback's sender   BroadcastReceiver that also takes the
                       (`broadcast.fallback`: FilesystemSender  fallback's announcements
                       or BusSender) as its fallback            (FallbackReceiver)
    "filesystem"       FilesystemSender, no fallback            FilesystemReceiver
    "bus"              BusSender, no fallback                   BusReceiver

Under the broadcast method the trainer also gets a `broadcaster.regroup.GroupFormer`
(`build_group_former`): when a producer joins or a member dies, it forms a new group with a new
rendezvous instead of leaving the method. A producer restarted or added later is built with
`in_group=False`: it takes the fallback's announcements until a re-formed group lists it. A
trainer that was restarted or resumed (`restarted=True`) starts on the fallback's sender
(`broadcast.fallback`: filesystem or bus), which is also its fallback (the producers are in the
dead trainer's group, which nobody sends to), and gets a group former: it re-forms the group with
the live producers (`trainer.publish.WeightPublisher`, `rejoin`). The bus method
(`broadcaster.bus_method`) needs the `weights` endpoint (`bus=`, a `BusLink`); it has no group,
so a restarted trainer simply serves on it again.

This module imports no torch at load time (the method modules are imported by the builders), so
`busctl up` can ask `needs_rendezvous_port` without paying for torch.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broadcaster.base import WeightReceiver, WeightSender
    from broadcaster.bus_method import BusLink
    from broadcaster.regroup import GroupFormer

log = logging.getLogger(__name__)

METHODS = ("broadcast", "filesystem", "bus")
"""The values of `broadcast.method`."""

FALLBACKS = ("filesystem", "bus")
"""The values of `broadcast.fallback`."""


def _method(cfg: Any) -> str:
    if cfg.method not in METHODS:
        raise ValueError(f"broadcast.method must be one of {METHODS}, got {cfg.method!r}")
    if getattr(cfg, "fallback", "filesystem") not in FALLBACKS:
        raise ValueError(f"broadcast.fallback must be one of {FALLBACKS}, got {cfg.fallback!r}")
    return cfg.method


def _fallback(cfg: Any) -> str:
    """`cfg.fallback` ("filesystem" for a config object without the field)."""
    return getattr(cfg, "fallback", "filesystem")


def _need_link(bus: BusLink | None, what: str) -> BusLink:
    if bus is None:
        raise ValueError(
            f"{what} uses the bus method (broadcast.method or broadcast.fallback: bus): pass bus=BusLink(...) "
            "with the run's weights endpoint"
        )
    return bus


def open_rendezvous_warning(cfg: Any) -> str | None:
    """What the broadcast method exposes when its rendezvous is reachable from other hosts, or None.

    Under `broadcast.method: broadcast` with `cfg.host` not a loopback address (a run across
    hosts), torch.distributed's TCPStore at `host:port` and the gloo/NCCL connections accept any
    peer that reaches them: nothing authenticates a member. The trainer logs this at start
    (`build_senders`); the bus method is the CurveZMQ-authenticated path.

    Args:
        cfg: a `configs.schema.BroadcastConfig`.
    """
    if cfg.method != "broadcast":
        return None
    try:
        if ipaddress.ip_address(cfg.host).is_loopback:
            return None
    except ValueError:
        if cfg.host == "localhost":
            return None
    return (
        f"broadcast.method: broadcast rendezvouses at {cfg.host}:{cfg.port or '(picked)'}: torch.distributed's TCPStore "
        "and the gloo/NCCL connections accept any peer that reaches that address, which could join the group, disturb "
        "it or read the weights; broadcast.method: bus sends them over the CurveZMQ-authenticated bus "
        "(docs/operations.md)"
    )


def needs_rendezvous_port(cfg: Any) -> bool:
    """Whether `busctl up` must pick a free port for `cfg.port` before starting the components:
    the broadcast method needs a rendezvous port and `cfg.port` is 0 ("pick one").

    Args:
        cfg: a `configs.schema.BroadcastConfig` (the run config's `broadcast`).

    Raises:
        ValueError: an unknown `cfg.method`.
    """
    return _method(cfg) == "broadcast" and cfg.port == 0


def build_senders(
    cfg: Any, *, world_size: int, out_dir: str | Path, restarted: bool = False, bus: BusLink | None = None
) -> tuple[WeightSender, WeightSender | None]:
    """The trainer's sender for `cfg.method` and the sender it falls back to (None: none).

    Args:
        cfg: a `configs.schema.BroadcastConfig`.
        world_size: 1 (the trainer) + the number of producer workers (broadcast group size).
        out_dir: root of the filesystem method's version directories (`RUN_DIR/weights`).
        restarted: the trainer was restarted or resumed: under the broadcast method the fallback's
            sender is both the sender and the fallback until a re-formed group replaces it
            (module docstring).
        bus: the `weights` endpoint and the trainer's context (needed when the bus method is used).

    Returns: (sender, fallback); the sender is not opened yet (`WeightSender.open`).

    Raises:
        ValueError: an unknown `cfg.method` / `cfg.fallback`, a bad broadcast setting
            (`BroadcastSender`), or the bus method without `bus`.
    """
    from broadcaster.dist_broadcast import BroadcastSender

    def make(method: str) -> WeightSender:
        if method == "bus":
            from broadcaster.bus_method import BusSender

            link = _need_link(bus, "the trainer")
            assert link.ctx is not None, "the trainer's BusLink carries its zmq context"
            return BusSender(link.ctx, link.address)
        from broadcaster.filesystem import FilesystemSender

        return FilesystemSender(out_dir)

    method = _method(cfg)
    if method != "broadcast":
        return make(method), None
    if (warning := open_rendezvous_warning(cfg)) is not None:
        log.warning("%s", warning)
    fallback = make(_fallback(cfg))
    if restarted:
        return fallback, fallback
    sender = BroadcastSender(cfg.backend, cfg.host, cfg.port, world_size, timeout_s=cfg.timeout_s)
    return sender, fallback


def build_group_former(cfg: Any) -> GroupFormer | None:
    """The trainer's `broadcaster.regroup.GroupFormer` under the broadcast method (None under the
    filesystem method); a restarted trainer gets one too (see the module docstring).

    Raises:
        ValueError: an unknown `cfg.method` or backend, or `cfg.reform_timeout_s <= 0`.
    """
    if _method(cfg) != "broadcast":
        return None
    from broadcaster.regroup import GroupFormer

    return GroupFormer(cfg.backend, cfg.host, timeout_s=cfg.reform_timeout_s)


def build_receiver(
    cfg: Any, engine: Any, *, rank: int, world_size: int, in_group: bool, name: str = "", bus: BusLink | None = None
) -> WeightReceiver:
    """The producer's receiver for `cfg.method` (not joined yet: `WeightReceiver.join`).

    Args:
        cfg: a `configs.schema.BroadcastConfig`.
        engine: the producer's `producers.engine.RolloutEngine`.
        rank: this engine's first rank in the broadcast group (1 + the producer's index).
        world_size: 1 (the trainer) + the number of producer workers.
        in_group: False for a producer restarted or added after the group was formed.
        name: the producer's name (`producer-i`): how re-formed groups list their members.
        bus: the `weights` endpoint and the CurveZMQ keys (needed when the bus method is used).

    Raises:
        ValueError: an unknown `cfg.method` / `cfg.fallback`, or the bus method without `bus`.
    """
    from broadcaster.base import FallbackReceiver
    from broadcaster.dist_broadcast import BroadcastReceiver

    def make(method: str) -> WeightReceiver:
        if method == "bus":
            from broadcaster.bus_method import BusReceiver

            return BusReceiver(engine, _need_link(bus, name or "a producer"), name=name, timeout_s=cfg.timeout_s)
        from broadcaster.filesystem import FilesystemReceiver

        return FilesystemReceiver(engine)

    method = _method(cfg)
    if method != "broadcast":
        return make(method)
    broadcast = BroadcastReceiver(
        engine,
        host=cfg.host,
        port=cfg.port,
        rank=rank,
        world_size=world_size,
        backend=cfg.backend,
        timeout_s=cfg.timeout_s,
        in_group=in_group,
        name=name,
        reform_timeout_s=cfg.reform_timeout_s,
    )
    return FallbackReceiver(broadcast, make(_fallback(cfg)))
