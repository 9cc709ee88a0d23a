"""The one place that turns `broadcast.method` (`configs.schema.BroadcastConfig`) into senders and receivers.

    broadcast.method   trainer (build_senders)                       producer (build_receiver)
    "broadcast"        BroadcastSender + the fallback's sender        FallbackReceiver(BroadcastReceiver,
                       (`broadcast.fallback`: filesystem or bus)        the fallback's receiver)
    "filesystem"       FilesystemSender, no fallback                  FilesystemReceiver
    "bus"              BusSender, no fallback                         BusReceiver

Under the broadcast method the trainer also gets a `GroupFormer` (`build_group_former`); a restarted trainer starts
on the fallback sender (docs/ARCHITECTURE.md, "Weights"). No torch import at load time, so `busctl up` can call
`needs_rendezvous_port` cheaply.
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
    """The warning for a broadcast rendezvous on a non-loopback `cfg.host` (nothing authenticates a member), or None."""
    if cfg.method != "broadcast":
        return None
    try:
        if ipaddress.ip_address(cfg.host).is_loopback:
            return None
    except ValueError:
        if cfg.host == "localhost":
            return None
    return (
        f"broadcast.method: broadcast rendezvouses at {cfg.host}:{cfg.port or '(picked)'}: "
        "torch.distributed's TCPStore and the gloo/NCCL connections accept any peer that reaches that address, "
        "which could join the group, disturb it or read the weights; "
        "broadcast.method: bus sends them over the CurveZMQ-authenticated bus "
        "(docs/operations.md)"
    )


def needs_rendezvous_port(cfg: Any) -> bool:
    """Whether `busctl up` must pick the rendezvous port (broadcast method, `cfg.port` 0). ValueError: bad method."""
    return _method(cfg) == "broadcast" and cfg.port == 0


def build_senders(
    cfg: Any, *, world_size: int, out_dir: str | Path, restarted: bool = False, bus: BusLink | None = None
) -> tuple[WeightSender, WeightSender | None]:
    """(sender, fallback or None) for the trainer; the sender is not opened yet.
    `world_size`: 1 + producer workers; `out_dir`: `RUN_DIR/weights`; `restarted`: the fallback sender is both
    until a re-formed group replaces it; `bus`: needed by the bus method. Raises ValueError: an unknown method or
    fallback, a bad broadcast setting, the bus method without `bus`."""
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
    """The trainer's `GroupFormer` under the broadcast method, else None.
    Raises ValueError: an unknown method or backend, or `cfg.reform_timeout_s <= 0`."""
    if _method(cfg) != "broadcast":
        return None
    from broadcaster.regroup import GroupFormer

    return GroupFormer(cfg.backend, cfg.host, timeout_s=cfg.reform_timeout_s)


def build_receiver(
    cfg: Any, engine: Any, *, rank: int, world_size: int, in_group: bool, name: str = "", bus: BusLink | None = None
) -> WeightReceiver:
    """The producer's receiver (not joined yet); arguments as `BroadcastReceiver`'s, `bus` for the bus method.
    Raises ValueError: an unknown method or fallback, or the bus method without `bus`."""
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
