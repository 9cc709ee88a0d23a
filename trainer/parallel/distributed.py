"""Data-parallel training under torchrun: the group, each rank's share of a step's micro-batches, and
the reduction of gradients (summed) and step stats (gathered, merged in rank order); roles and
invariants: docs/ARCHITECTURE.md, "Data parallelism". Leader -> followers protocol, on a gloo group:
an ``int64 [2 + W]`` header ``[kind, slots, size_0, ..., size_{W-1}]`` broadcast from rank 0, then a
``uint8 [max(size_r)]`` payload scattered from it unless every size is 0; a share is a msgpack list
of encoded :class:`bus.messages.MicroBatch` frames, checked by :func:`bus.codec.decode` (no pickle).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from broadcaster.dist_broadcast import Backend, resolve_backend
from bus.codec import decode, encode
from bus.messages import MicroBatch

log = logging.getLogger(__name__)

__all__ = [
    "DataParallel",
    "decode_share",
    "encode_share",
    "launcher_pid",
    "share_micro_batches",
    "sum_gradients_hook",
]

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables torchrun sets in every rank (``init_method="env://"`` reads them)."""

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set by torchrun: a rendezvous store is the agent's (``torch.distributed.rendezvous``)."""

STEP, TEXT, STOP, GATHER, SAVE = 1, 2, 3, 4, 5
"""Kinds of leader -> follower messages (header field 0)."""

STOP_WAIT_S = 10.0
"""Longest wait for the followers to take ``stop`` at shutdown (they may be dead), seconds."""


def share_micro_batches(num_tokens: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Share micro-batches of ``num_tokens`` (``[n]`` ints >= 1) among ``num_ranks`` by the LPT rule
    (Graham 1969): by decreasing tokens, each to the least-loaded rank with fewer than
    ``ceil(n / num_ranks)`` (ties: lower index, lower rank); ``share[rank]`` = indices, largest first,
    rank 0's holding the largest. Raises ValueError for ``num_ranks < 1``, no or empty micro-batches."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not num_tokens or min(num_tokens) < 1:
        raise ValueError(f"need >= 1 micro-batch, each with >= 1 token; got token counts {list(num_tokens)}")
    slots = -(-len(num_tokens) // num_ranks)
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for k in sorted(range(len(num_tokens)), key=lambda k: (-num_tokens[k], k)):
        rank = min((r for r in range(num_ranks) if len(shares[r]) < slots), key=lambda r: (load[r], r))
        shares[rank].append(k)
        load[rank] += num_tokens[k]
    return shares


def encode_share(micro_batches: Sequence[MicroBatch]) -> bytes:
    """A rank's share as bytes: msgpack list of each micro-batch's wire frames (no pickle)."""
    return msgpack.packb([[bytes(frame) for frame in encode(mb)] for mb in micro_batches], use_bin_type=True)


def decode_share(payload: bytes | memoryview) -> list[MicroBatch]:
    """Inverse of :func:`encode_share`; ValueError for anything but a list of valid MicroBatch frames."""
    items = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(items, list) or not all(isinstance(frames, list) for frames in items):
        raise ValueError("a data-parallel share must be a msgpack list of frame lists")
    share = [decode(frames) for frames in items]
    for mb in share:
        if not isinstance(mb, MicroBatch):
            raise ValueError(f"a data-parallel share holds micro-batches only, got {type(mb).__name__}")
    return share


def sum_gradients_hook(group, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP communication hook: all-reduce each gradient bucket with SUM, not DDP's mean (the
    micro-batch losses are already divided by step-wide totals); a ``Future`` of the summed buffer."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def launcher_pid() -> int:
    """The pid the supervisor spawned: under torchrun the elastic agent (our parent), else ours."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


@dataclass
class DataParallel:
    """This process's place in the trainer group: ``rank``, ``world_size``, ``local_rank`` from
    torchrun; ``device`` (``cuda:LOCAL_RANK`` with NCCL, else CPU); ``backend`` of the gradients;
    ``control_group``, the gloo group of the leader's messages and stats (None: the default)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    control_group: dist.ProcessGroup | None = None
    stopped: bool = False

    @classmethod
    def from_env(cls, backend: Backend, timeout_s: float, world_size: int | None = None) -> "DataParallel":
        """Join the group torchrun describes (``env://``); ``backend`` "auto" (nccl with CUDA, else
        gloo), "gloo" or "nccl"; ``timeout_s`` bounds every collective; ``world_size``: the expected
        rank count (None: any). Raises ValueError outside torchrun, for another world size, or nccl
        without CUDA."""
        missing = [k for k in TORCHRUN_ENV if k not in os.environ]
        if missing:
            raise ValueError(
                f"data-parallel training needs torchrun's environment ({', '.join(missing)} unset): launch with "
                "`python -m torch.distributed.run --nproc-per-node N -m trainer.proc ...` (busctl up does this when "
                "trainer.data_parallel > 1)"
            )
        rank, size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if world_size is not None and size != world_size:
            raise ValueError(
                f"torchrun started {size} ranks but trainer.data_parallel is {world_size}; make them equal"
            )
        resolved = resolve_backend(backend)
        if resolved == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("trainer.dp_backend nccl needs CUDA; use gloo (or auto) on CPU")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(resolved, init_method="env://", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if resolved == "nccl" else None
        # torchrun sets this so env:// joins the store its agent hosts (done, above). Left set, every
        # later TCPStore of this process would also connect as a client: rank 0's weight-broadcast
        # group (broadcaster/) would wait for a store that nobody hosts.
        os.environ.pop(AGENT_STORE_ENV, None)
        log.info("data-parallel rank %d/%d (local %d) on %s, %s", rank, size, local_rank, device, resolved)
        return cls(rank, size, local_rank, device, resolved, control)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that talks to the bus."""
        return self.rank == 0

    # -- gradients and stats ----------------------------------------------------------------------

    def wrap(self, module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        """``module`` in DDP with summed gradients, buffers not re-broadcast per forward (rotary
        frequencies are constants). A collective: the constructor broadcasts rank 0's parameters."""
        ddp = torch.nn.parallel.DistributedDataParallel(
            module,
            device_ids=[self.local_rank] if self.device.type == "cuda" else None,
            forward_sync_buffers=False,
        )
        ddp.register_comm_hook(None, sum_gradients_hook)
        return ddp

    @staticmethod
    def grad_sync(module: torch.nn.Module, sync: bool) -> AbstractContextManager:
        """Context of one micro-batch's backward: DDP's ``no_sync()`` but for the step's last
        (``sync``); nothing for FSDP2, which reduce-scatters in every backward."""
        if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):  # FSDP2: every backward
            return nullcontext()
        return module.no_sync()

    def all_gather_stats(self, stats: dict[str, float]) -> list[dict[str, float]]:
        """Every rank's ``stats``, in rank order, on every rank (gathered, not all-reduced: a rank
        with padding slots only lacks the loss keys; msgpack float64)."""
        data = msgpack.packb({str(k): float(v) for k, v in stats.items()}, use_bin_type=True)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.control_group)
        width = max(int(n) for n in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.control_group)
        return [msgpack.unpackb(t.numpy()[: int(n)].tobytes(), raw=False) for t, n in zip(out, sizes)]

    # -- leader -> followers ----------------------------------------------------------------------

    def send_step(self, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch | None]:
        """Leader: send every follower its share of a step; returns its own, padded with ``None``.
        Raises ValueError if not the leader or without micro-batches."""
        self._check_leader("send_step")
        shares = share_micro_batches([len(mb.input_ids) for mb in micro_batches], self.world_size)
        slots = max(len(share) for share in shares)
        payloads = [encode_share([micro_batches[k] for k in share]) if r else b"" for r, share in enumerate(shares)]
        self._send(STEP, slots, payloads)
        own: list[MicroBatch | None] = [micro_batches[k] for k in shares[0]]
        return own + [None] * (slots - len(own))

    def send_text(self, text: str) -> None:
        """Leader: send every follower the same text (the checkpoint every rank resumes from)."""
        self._check_leader("send_text")
        data = text.encode()
        self._send(TEXT, 0, [b""] + [data] * (self.world_size - 1))

    def send_gather(self, index: int) -> None:
        """Leader: tell the followers to all-gather weight entry ``index`` now; ValueError if not the
        leader or the followers were stopped."""
        self._check_leader("send_gather")
        if self.stopped:
            raise ValueError("the data-parallel followers were stopped: sharded weights can no longer be gathered")
        self._send(GATHER, index, [b""] * self.world_size)

    def send_save(self, directory: str) -> None:
        """Leader: tell the followers to write their checkpoint shards into ``directory``."""
        self._check_leader("send_save")
        data = directory.encode()
        self._send(SAVE, 0, [b""] + [data] * (self.world_size - 1))

    def send_stop(self) -> None:
        """Leader: tell the followers to return (idempotent; waits at most :data:`STOP_WAIT_S`)."""
        self._check_leader("send_stop")
        if self.stopped:
            return
        self.stopped = True
        header = torch.tensor([STOP, 0] + [0] * self.world_size, dtype=torch.int64)
        work = dist.broadcast(header, src=0, group=self.control_group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=STOP_WAIT_S))
        except RuntimeError as exc:  # torch.distributed errors: a follower died first
            log.warning("followers did not take stop (%s: %s)", type(exc).__name__, exc)

    def recv_step(self) -> list[MicroBatch | None] | None:
        """Follower: this rank's share of the next step, padded with ``None``; None after ``stop``
        (ValueError for another kind)."""
        kind, slots, payload = self._recv()
        if kind == STOP:
            return None
        if kind != STEP:
            raise ValueError(f"rank {self.rank} expected a step or stop from the leader, got message kind {kind}")
        return self._share(slots, payload)

    def recv_command(self) -> tuple[int, object]:
        """Follower: ``(STEP, share)``, ``(GATHER, entry)``, ``(SAVE, directory)`` or ``(STOP, None)``
        (ValueError for another kind)."""
        kind, slots, payload = self._recv()
        if kind == STEP:
            return kind, self._share(slots, payload)
        if kind == GATHER:
            return kind, slots
        if kind == SAVE:
            return kind, bytes(payload).decode()
        if kind == STOP:
            return kind, None
        raise ValueError(
            f"rank {self.rank} expected a step, gather, save or stop from the leader, got message kind {kind}"
        )

    def _share(self, slots: int, payload: memoryview) -> list[MicroBatch | None]:
        share: list[MicroBatch | None] = list(decode_share(payload))
        if len(share) > slots:
            raise ValueError(f"rank {self.rank} got {len(share)} micro-batches for {slots} slots")
        return share + [None] * (slots - len(share))

    def recv_text(self) -> str:
        """Follower: the leader's :meth:`send_text` (ValueError for another kind)."""
        kind, _, payload = self._recv()
        if kind != TEXT:
            raise ValueError(f"rank {self.rank} expected a text from the leader, got message kind {kind}")
        return bytes(payload).decode()

    def close(self) -> None:
        """Leader: send ``stop``; every rank: leave the group (idempotent). Unwrap DDP first
        (``Trainer.disable_data_parallel``)."""
        if not dist.is_initialized():
            return
        if self.is_leader:
            self.send_stop()
        dist.destroy_process_group()

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise ValueError(f"{what} is the leader's (rank 0); this is rank {self.rank}")

    def _send(self, kind: int, slots: int, payloads: list[bytes]) -> None:
        sizes = [len(p) for p in payloads]
        header = torch.tensor([kind, slots, *sizes], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control_group)
        if max(sizes) == 0:
            return
        width = max(sizes)
        buffers = [torch.zeros(width, dtype=torch.uint8) for _ in payloads]
        for buf, data in zip(buffers, payloads):
            if data:
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(width, dtype=torch.uint8)
        dist.scatter(out, buffers, src=0, group=self.control_group)

    def _recv(self) -> tuple[int, int, memoryview]:
        header = torch.empty(2 + self.world_size, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control_group)
        kind, slots, *sizes = header.tolist()
        if max(sizes) == 0:
            return kind, slots, memoryview(b"")
        out = torch.empty(max(sizes), dtype=torch.uint8)
        dist.scatter(out, None, src=0, group=self.control_group)
        return kind, slots, memoryview(out.numpy())[: sizes[self.rank]]
