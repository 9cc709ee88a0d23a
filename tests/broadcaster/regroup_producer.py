"""A producer's weight path in its own process, for the re-forming-group tests
(`tests/broadcaster/test_regroup.py`): the control-loop rules of `producers.proc` over a real
`BroadcastReceiver` whose engine is the vLLM worker extension's own code
(`WeightSyncExtension.init_weight_group` / `destroy_weight_group` / `receive_weights`), with the
vLLM model reload replaced by reporting what arrived.

A process, not a thread of the test: each producer's gloo ranks live in their own address space as
in a run (ranks formed from threads of one process crashed CI once inside torch's TCPStore
creation). Kept apart from the test module so a child imports only the producer side.
"""

from __future__ import annotations

import asyncio
import queue
import traceback

import torch

from broadcaster.factory import build_receiver
from broadcaster.worker_extension import WeightSyncExtension
from bus.messages import WeightsApplied, WeightsReady, WeightsWanted, new_id
from bus.messages_weights import WeightGroup, WeightGroupAck
from configs.schema import BroadcastConfig
from tests.weight_peer import SPAWN, tensors_from_bytes, tensors_to_bytes

REFORM_TIMEOUT_S = 6.0


class _Worker(WeightSyncExtension):
    """The worker extension in a producer process: what it loads is reported instead of reloaded
    into vLLM."""

    device = torch.device("cpu")
    rank = 0

    def __init__(self, reports) -> None:
        self.reports = reports

    def _rlbus_apply(self, weights) -> None:
        self.reports.put(("loaded", tensors_to_bytes({name: tensor.clone() for name, tensor in weights})))


class _Engine:
    """The `RolloutEngine` weight calls, run by the worker extension in a worker thread; each
    version taken is reported as ``("version", method, version)``."""

    def __init__(self, reports) -> None:
        self.worker = _Worker(reports)
        self.reports = reports
        self.version = 0

    async def init_weight_group(self, host, port, *, rank, world_size, backend, timeout_s) -> None:
        await asyncio.to_thread(self.worker.init_weight_group, host, port, rank, world_size, backend, timeout_s)

    async def leave_weight_group(self) -> None:
        self.worker.destroy_weight_group()

    async def update_weights(self, version, manifest, resend=False) -> None:
        await asyncio.to_thread(self.worker.receive_weights, manifest)
        self.version = version
        self.reports.put(("version", "broadcast", version))

    async def load_weights_from_path(self, version, path) -> None:
        self.version = version
        self.reports.put(("version", "filesystem", version))


DEAFEN = "deafen"  # inbox command: the producer is dead from here on, it never answers again


async def _producer_loop(
    name: str, index: int, inbox, to_trainer, reports, in_group: bool, port: int, world_size: int
) -> None:
    """One producer's weight path: the control-loop rules of `producers.proc`."""
    engine = _Engine(reports)
    receiver = build_receiver(
        BroadcastConfig(backend="gloo", port=port, timeout_s=30, reform_timeout_s=REFORM_TIMEOUT_S),
        engine,
        rank=1 + index,
        world_size=world_size,
        in_group=in_group,
        name=name,
    )
    listening = True
    await receiver.join()
    if receiver.wants_group:
        to_trainer.put(WeightsWanted(id=new_id(), producer=name, version=engine.version))
    while True:
        msg = await asyncio.to_thread(inbox.get)
        if msg is None:
            engine.worker.destroy_weight_group()
            return
        if msg == DEAFEN:
            listening = False
        if not listening:  # dead: never acknowledges nor joins anything again
            continue
        if isinstance(msg, WeightGroup):
            ack = WeightGroupAck(id=new_id(), producer=name, generation=msg.generation)
            await receiver.regroup(msg, lambda ack=ack: to_trainer.put(ack))
        elif isinstance(msg, WeightsReady) and (
            msg.version != engine.version or receiver.must_apply(msg, engine.version)
        ):
            if receiver.skip_reason(msg, engine.version) is None:
                await receiver.apply(msg)
                to_trainer.put(WeightsApplied(id=new_id(), producer=name, version=msg.version, apply_time_s=0.0))


def _producer_main(
    name: str, index: int, inbox, to_trainer, reports, in_group: bool, port: int, world_size: int
) -> None:
    try:
        asyncio.run(_producer_loop(name, index, inbox, to_trainer, reports, in_group, port, world_size))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
    reports.put(("stopped", None))


class Producer:
    """A producer process (as in a run: its own process, its own gloo ranks), its control
    messages through `inbox`; what it took (``versions``, ``loaded``) and its ``errors`` are
    mirrored here by `refresh`."""

    def __init__(self, name: str, index: int, to_trainer, *, in_group: bool, port: int, world_size: int):
        self.name = name
        self.inbox, self.reports = SPAWN.Queue(), SPAWN.Queue()
        self.versions: list[tuple[str, int]] = []
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.errors: list[str] = []
        self.stopped = False
        self.proc = SPAWN.Process(
            target=_producer_main,
            daemon=True,
            args=(name, index, self.inbox, to_trainer, self.reports, in_group, port, world_size),
        )
        self.proc.start()

    @classmethod
    def trainer_inbox(cls):
        """A queue the producer processes can put to (the trainer's inbox)."""
        return SPAWN.Queue()

    def refresh(self, timeout_s: float = 0.0) -> None:
        """Mirror the reports the process has sent (waiting up to `timeout_s` for the first)."""
        try:
            report = self.reports.get(timeout=timeout_s) if timeout_s else self.reports.get_nowait()
            while True:
                kind, *rest = report
                if kind == "version":
                    self.versions.append(tuple(rest))
                elif kind == "loaded":
                    self.loaded.append(tensors_from_bytes(rest[0]))
                elif kind == "error":
                    self.errors.append(rest[0])
                else:
                    self.stopped = True
                report = self.reports.get_nowait()
        except queue.Empty:
            return

    def deafen(self) -> None:
        self.inbox.put(DEAFEN)

    def stop(self) -> None:
        self.inbox.put(None)
        for _ in range(60):
            self.refresh(0.5)
            if self.stopped:
                break
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
