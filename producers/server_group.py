"""The broadcast method (`broadcast.method: broadcast`) on a producer's inference server: `ServerEngine`'s side.

The server's vLLM worker joins the trainer's torch.distributed group as the producer's rank, through the server's
`/collective_rpc` into `broadcaster.worker_extension` (`init_weight_group`, `destroy_weight_group`), and receives each
version by `receive_weights` under the engine's drained update. A producer is one rank, so it drives one server. A
broadcast cannot be replayed: a server lost meanwhile stays closed (`weight_group`) until a re-formed group takes it
back (`broadcaster.dist_broadcast.BroadcastReceiver.lost_group` asks for one).
"""

from __future__ import annotations

import asyncio
import logging

from producers.server_clients import ServerUnavailable

log = logging.getLogger(__name__)

BROADCAST_RPC = "receive_weights"
"""The worker method of the broadcast method: its send cannot be replayed on a server that missed it."""


class WeightGroupMixin:
    """`ServerEngine`'s weight-group methods (`self` has `_slots`, `_group`, `_update_lock`, `_require`,
    `apply_rpc`)."""

    @property
    def weight_group(self) -> str:
        """ "in": no group joined, or every server in it; "healing": one was lost (restarted, or its version tag
        gone) and is not back; "out": it is back, closed until a re-formed group takes it in
        (`BroadcastReceiver.lost_group` asks for one)."""
        lost = [slot for slot in self._slots if not slot.in_group]
        if self._group is None or not lost:
            return "in"
        return "healing" if any(slot.healing is not None for slot in lost) else "out"

    async def init_weight_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float | None = None
    ) -> None:
        """Join the trainer's broadcast group as `rank` (`RolloutEngine.init_weight_group`): the server's worker
        leaves any stale group and joins through `/collective_rpc`; blocks until every rank joined. A server being
        restarted is waited for first. ValueError: more than one server (a producer is one rank)."""
        self._require()
        if len(self._slots) != 1:
            raise ValueError(f"the broadcast method takes one server per producer, this one has {len(self._slots)}")
        slot = self._slots[0]
        if slot.healing is not None:
            await asyncio.shield(slot.healing)
        group = dict(host=host, port=port, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s)
        async with self._update_lock:
            await slot.client.call("destroy_weight_group", {})
            await slot.client.call("init_weight_group", group)
            slot.in_group, self._group = True, group
        log.info("%s joined the weight group %s:%d as rank %d/%d", slot.url, host, port, rank, world_size)

    async def leave_weight_group(self) -> None:
        """Leave the broadcast group (the trainer re-forms it) on every server that answers."""
        async with self._update_lock:
            for slot in self._slots:
                if slot.in_group and slot.healing is None:
                    try:
                        await slot.client.call("destroy_weight_group", {})
                    except ServerUnavailable as exc:
                        log.warning("%s did not leave the weight group (%s)", slot.url, exc)
                slot.in_group = False
            self._group = None

    async def update_weights(
        self, version: int, manifest: list[list], bucket_bytes: int | None = None, *, resend: bool = False
    ) -> float:
        """Receive a broadcast of `manifest` as `version` on the server in the group; seconds (drain included).
        ValueError as `RolloutEngine.update_weights`; RuntimeError: no server in the group."""
        kwargs = {"manifest": manifest} | ({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes})
        return await self.apply_rpc(version, BROADCAST_RPC, kwargs, resend=resend)
