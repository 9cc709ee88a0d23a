"""The one place that turns `broadcast.method` (configs/schema.py `BroadcastConfig`) into weight
senders and receivers: every other module works with `broadcaster.base.WeightSender` /
`WeightReceiver` objects and never compares method names.

    broadcast.method   trainer (build_senders)                 producer (build_receiver)
    "broadcast"        BroadcastSender, FilesystemSender as     BroadcastReceiver that also takes
                       its fallback (a failed broadcast)        filesystem announcements (FallbackReceiver)
    "filesystem"       FilesystemSender, no fallback            FilesystemReceiver

Under the broadcast method the trainer also gets a `broadcaster.regroup.GroupFormer`
(`build_group_former`): when a producer joins or a member dies, it forms a new group with a new
rendezvous instead of leaving the method. A producer restarted or added later is built with
`in_group=False`: it takes filesystem announcements until a re-formed group lists it. A trainer
that was restarted or resumed (`restarted=True`) starts on the filesystem sender, which is also its
fallback (the producers are in the dead trainer's group, which nobody sends to), and gets a group
former: it re-forms the group with the live producers (`trainer.publish.WeightPublisher`, `rejoin`).

This module imports no torch at load time (the method modules are imported by the builders), so
`busctl up` can ask `needs_rendezvous_port` without paying for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broadcaster.base import WeightReceiver, WeightSender
    from broadcaster.regroup import GroupFormer

METHODS = ("broadcast", "filesystem")
"""The values of `broadcast.method`."""


def _method(cfg: Any) -> str:
    if cfg.method not in METHODS:
        raise ValueError(f"broadcast.method must be one of {METHODS}, got {cfg.method!r}")
    return cfg.method


def needs_rendezvous_port(cfg: Any) -> bool:
    """Whether `busctl up` must pick a free port for `cfg.port` before starting the components:
    the broadcast method needs a rendezvous port and `cfg.port` is 0 ("pick one").

    Args:
        cfg: a `configs.schema.BroadcastConfig` (the run config's `broadcast`).

    Raises:
        ValueError: an unknown `cfg.method`.
    """
    return _method(cfg) == "broadcast" and cfg.port == 0


def build_senders(cfg: Any, *, world_size: int, out_dir: str | Path,
                  restarted: bool = False) -> tuple[WeightSender, WeightSender | None]:
    """The trainer's sender for `cfg.method` and the sender it falls back to (None: none).

    Args:
        cfg: a `configs.schema.BroadcastConfig`.
        world_size: 1 (the trainer) + the number of producer workers (broadcast group size).
        out_dir: root of the filesystem method's version directories (`RUN_DIR/weights`).
        restarted: the trainer was restarted or resumed: under the broadcast method the filesystem
            sender is both the sender and the fallback until a re-formed group replaces it
            (module docstring).

    Returns: (sender, fallback); the sender is not opened yet (`WeightSender.open`).

    Raises:
        ValueError: an unknown `cfg.method`, or a bad broadcast setting (`BroadcastSender`).
    """
    from broadcaster.broadcast import BroadcastSender
    from broadcaster.filesystem import FilesystemSender

    filesystem = FilesystemSender(out_dir)
    if _method(cfg) == "filesystem":
        return filesystem, None
    if restarted:
        return filesystem, filesystem
    sender = BroadcastSender(cfg.backend, cfg.host, cfg.port, world_size, timeout_s=cfg.timeout_s)
    return sender, filesystem


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


def build_receiver(cfg: Any, engine: Any, *, rank: int, world_size: int, in_group: bool,
                   name: str = "") -> WeightReceiver:
    """The producer's receiver for `cfg.method` (not joined yet: `WeightReceiver.join`).

    Args:
        cfg: a `configs.schema.BroadcastConfig`.
        engine: the producer's `producers.engine.RolloutEngine`.
        rank: this engine's first rank in the broadcast group (1 + the producer's index).
        world_size: 1 (the trainer) + the number of producer workers.
        in_group: False for a producer restarted or added after the group was formed.
        name: the producer's name (`producer-i`): how re-formed groups list their members.

    Raises:
        ValueError: an unknown `cfg.method`.
    """
    from broadcaster.base import FallbackReceiver
    from broadcaster.broadcast import BroadcastReceiver
    from broadcaster.filesystem import FilesystemReceiver

    filesystem = FilesystemReceiver(engine)
    if _method(cfg) == "filesystem":
        return filesystem
    broadcast = BroadcastReceiver(engine, host=cfg.host, port=cfg.port, rank=rank, world_size=world_size,
                                  backend=cfg.backend, timeout_s=cfg.timeout_s, in_group=in_group, name=name,
                                  reform_timeout_s=cfg.reform_timeout_s)
    return FallbackReceiver(broadcast, filesystem)

