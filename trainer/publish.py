"""Weight publication after each optimizer step: :class:`WeightPublisher` holds the sender of the
run's method and its fallback, re-forms the broadcast group as producers join or die, and falls
back when it cannot (docs/ARCHITECTURE.md, "Weights"); :func:`weights_payload` is what the producers
get. Weights travel in the producers' dtype (:func:`weights_dtype`), cast by the sender as it copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from prometheus_client import Counter, Gauge, Histogram

from broadcaster.base import SendFailed, WeightSender
from broadcaster.regroup import GroupFormer, Membership
from broadcaster.dtypes import resolve_producer_dtype
from broadcaster.manifest import build_manifest, parse_dtype
from broadcaster.noise import is_rmsnorm_weight, qerl_noise_sigma, with_rmsnorm_noise
from bus.messages import Message, WeightsApplied, WeightsReady, WeightsWanted, new_id
from bus.messages_weights import WeightGroup, WeightGroupAck
from trainer.parallel.distributed import DataParallel
from trainer.state.model import lora_adapter_state_dict, policy_state_dict
from trainer.parallel.sharding import GatheredWeights, is_sharded

log = logging.getLogger(__name__)

BROADCAST_SECONDS = Histogram(
    "rlbus_trainer_weight_broadcast_seconds",
    "Time the trainer thread spends publishing new weights (a broadcast's bytes then move in the background), seconds",
)
TRANSFER_SECONDS = Histogram(
    "rlbus_trainer_weight_transfer_seconds",
    "Duration of a background weight broadcast, start to every producer received, seconds",
)
BROADCAST_FALLBACKS = Counter(
    "rlbus_trainer_broadcast_fallbacks_total",
    "Weight broadcasts that raised (a producer died, a gloo/nccl error) with no group to re-form; the trainer "
    "then uses the fallback method (broadcast.fallback: filesystem or bus)",
)
GROUP_REFORMS = Counter(
    "rlbus_trainer_weight_group_reforms_total",
    "Attempts to re-form the weight-broadcast group (a producer joined or a member died), by outcome: ok, or failed "
    "(timed out; the members that never acknowledged take weights by the filesystem method)",
    ["outcome"],
)
WEIGHT_MEMBERS = Gauge(
    "rlbus_trainer_weight_members",
    "Producers that take weights by each method: broadcast (members of the current weight group), filesystem or bus",
    ["method"],
)
for _outcome in ("ok", "failed"):  # export every series from the start, at 0
    GROUP_REFORMS.labels(outcome=_outcome)
WEIGHT_METHODS = ("broadcast", "filesystem", "bus")
"""The ``method`` labels of ``rlbus_trainer_weight_members`` (``broadcast.method`` values)."""
for _method in WEIGHT_METHODS:
    WEIGHT_MEMBERS.labels(method=_method)


def weights_payload(
    model: torch.nn.Module, cfg, version: int, *, adapter: bool, dp: DataParallel | None = None
) -> Mapping[str, torch.Tensor]:
    """What the producers get as ``version`` (``cfg``: the ``RunConfig``): the merged full weights, or
    with ``adapter`` the LoRA adapter (plus whole RMSNorm weights under the noise scheduler, which
    makes them noisy copies: QeRL, :mod:`broadcaster.noise`; ``model``'s stay clean); a sharded model
    gives :class:`trainer.parallel.sharding.GatheredWeights` (rank 0 of ``dp``). Raises ValueError for
    a sharded model with the noise scheduler or without ``dp``."""
    noise = cfg.broadcast.noise_scheduler
    if is_sharded(model):
        if noise.enabled or dp is None:
            raise ValueError(
                "sharded (trainer.parallel: fsdp) weights are sent without broadcast.noise_scheduler, by rank 0 of "
                "the data-parallel group; disable the noise scheduler or use trainer.parallel: ddp"
            )
        return GatheredWeights(model, dp.send_gather)
    if adapter:
        state = lora_adapter_state_dict(model, include=is_rmsnorm_weight if noise.enabled else None)
    else:
        state = policy_state_dict(model)
    if not noise.enabled:
        return state
    sigma = qerl_noise_sigma(
        version,
        cfg.trainer.max_steps,
        sigma_start=noise.sigma_start,
        sigma_end=noise.sigma_end,
        num_stages=noise.num_stages,
    )
    return with_rmsnorm_noise(state, sigma, seed=noise.seed, version=version)


def weights_dtype(cfg) -> torch.dtype:
    """The dtype the weights travel in: ``cfg.producers.dtype``, ``auto`` resolved as the producers
    do (:func:`broadcaster.dtypes.resolve_producer_dtype`)."""
    return parse_dtype(resolve_producer_dtype(cfg.producers.dtype, cuda_available=torch.cuda.is_available()))


class WeightPublisher:
    """Publishes each policy version to the producers through a swappable sender: ``sender`` (opened,
    :func:`broadcaster.factory.build_senders`) and ``fallback`` (filesystem or bus; None: failures
    raise); ``announce`` sends a control message; ``payload(version, adapter=...)`` gives the weights
    (``adapter``: LoRA adapters where the sender carries them) sent in ``dtype``; ``former`` re-forms
    the group of ``members`` (rank order; None: a failed broadcast falls back for the run); ``inbox``
    reads the publisher's own control subscriber; ``rejoin``: a restarted trainer, every producer on
    the fallback until it shows it is alive."""

    def __init__(
        self,
        sender: WeightSender,
        fallback: WeightSender | None,
        announce: Callable[[Message], None],
        payload: Callable[..., Mapping[str, torch.Tensor]],
        *,
        adapter: bool,
        dtype: torch.dtype | None = None,
        former: GroupFormer | None = None,
        members: Sequence[str] = (),
        inbox: Callable[[float], Message | None] | None = None,
        rejoin: bool = False,
    ) -> None:
        self.sender, self.fallback = sender, fallback
        self.filesystem = fallback
        """The fallback sender (kept for the producers moved to it after a failed re-form)."""
        self._send_message = announce
        self.payload = payload
        self.adapter = adapter
        self.dtype = dtype
        self.former = former if fallback is not None else None
        self.membership: Membership | None = None
        """Who takes weights how (None: no group management, see ``former``)."""
        self._joining: dict[str, int] = {}
        """Producers that asked to join (``weights.wanted``) -> the version they asked at."""
        self._rejoin = self.former is not None and rejoin
        """Producers not tried yet join at their first ``weights.applied`` (see the module docstring)."""
        if self._rejoin:  # everyone on the filesystem method until a re-form takes them in
            self.membership = Membership(time.time_ns() // 1_000_000, (), tuple(members))
        elif self.former is not None:
            self.membership = Membership(0, tuple(members))
        self._inbox = inbox
        self._tried: dict[str, int | None] = {}
        """Producer -> the last version at which a re-form took it in (one attempt per version)."""
        self._acks: dict[int, set[str]] = {}
        self._num_members = len(members)
        self._fs_last: dict | None = None
        """The last filesystem publication's info (re-announced, not rewritten, for its version)."""
        self.last_version: int | None = None
        """The version last handed to :meth:`publish` (None: none yet)."""
        self._count_members()

    @classmethod
    def for_run(
        cls,
        cfg,
        model: torch.nn.Module,
        sender: WeightSender,
        fallback: WeightSender | None,
        announce: Callable[[Message], None],
        dp: DataParallel | None = None,
        *,
        former: GroupFormer | None = None,
        inbox: Callable[[float], Message | None] | None = None,
        rejoin: bool = False,
    ) -> "WeightPublisher":
        """The publisher of a run (``cfg``: its ``RunConfig``) sending ``model``'s weights
        (:func:`weights_payload`); a sharded model gets no former."""
        return cls(
            sender,
            fallback,
            announce,
            lambda version, adapter: weights_payload(model, cfg, version, adapter=adapter, dp=dp),
            adapter=cfg.trainer.lora.enabled and cfg.broadcast.lora_payload == "adapter",
            dtype=weights_dtype(cfg),
            former=None if is_sharded(model) else former,
            members=[f"producer-{i}" for i in range(cfg.producers.replicas)],
            inbox=inbox,
            rejoin=rejoin,
        )

    @property
    def method(self) -> str:
        """The method in use (``broadcast.method`` values; what checkpoints record)."""
        return self.sender.method

    def publish(self, version: int) -> float:
        """Announce and send ``version`` (settling the previous transfer and serving joiners first;
        a failed send recovers and re-publishes); returns the seconds the trainer thread spent."""
        started = time.perf_counter()
        self.settle()
        self._read_inbox()
        if self._joining:
            self._regroup(None)  # this version, sent next, is the newcomers' first
        self.last_version = version
        try:
            self._publish(version, self._payload(version))
        except RuntimeError as exc:  # torch.distributed errors (DistBackendError, timeouts) are RuntimeErrors
            if self.fallback is None or self.sender is self.filesystem:
                raise  # nothing to fall back to (the filesystem method itself failed)
            self._recover(version, exc, None)
        elapsed = time.perf_counter() - started
        BROADCAST_SECONDS.observe(elapsed)
        return elapsed

    def settle(self) -> None:
        """Wait for the transfer in flight to reach every producer; a failed one re-forms the group
        (or falls back) and re-publishes its version from its send buffers."""
        try:
            done = self.sender.wait()
        except SendFailed as exc:
            if self.fallback is None:
                raise
            self._recover(exc.version, exc, exc.payload)
            return
        if done and done.get("transfer_s") is not None:
            TRANSFER_SECONDS.observe(done["transfer_s"])

    def serve_late_joiner(self, producer: str, version: int) -> None:
        """A producer outside the group wants ``version``: re-form the group with it and re-send the
        last version, or without a former fall back and re-publish it there (never leave it waiting)."""
        if self.former is not None:
            self._joining.setdefault(producer, version)
            self.settle()
            if self._joining:
                self._regroup(self.last_version)
            return
        if self.fallback is None or self.last_version is None:
            return
        self.settle()  # a transfer in flight finishes (or fails and falls back) first
        if self.fallback is None:
            return
        version_now = self.last_version
        self._fall_back(version_now, RuntimeError(f"{producer} is not in the weight group (wanted version {version})"))
        self._publish(version_now, self._payload(version_now))

    def poll(self) -> None:
        """Without blocking: settle a finished transfer (a failed one recovers now) and serve the
        producers that asked to join since."""
        if self.sender.transfer_finished():
            self.settle()
        for producer, version in self._read_inbox().items():
            if self.former is None or producer in self._joining:  # not taken in by a re-form for another one
                self.serve_late_joiner(producer, version)

    def close(self) -> None:
        """Close the senders (waits for a transfer in flight; idempotent)."""
        self.sender.close()
        if self.filesystem is not None and self.filesystem is not self.sender:
            self.filesystem.close()

    # -- re-forming the group ----------------------------------------------------------------------

    def _read_inbox(self) -> dict[str, int]:
        """Take the waiting messages; returns the join requests taken now (one per producer and version)."""
        asked: dict[str, int] = {}
        while self._inbox is not None and (msg := self._inbox(0.0)) is not None:
            if isinstance(msg, WeightGroupAck):
                self._acks.setdefault(msg.generation, set()).add(msg.producer)
            elif isinstance(msg, WeightsWanted) and self._tried.get(msg.producer, -1) != self.last_version:
                asked[msg.producer] = msg.version
            elif isinstance(msg, WeightsApplied) and self._rejoin and msg.producer not in self._tried:
                asked[msg.producer] = msg.version
        if self.former is not None:
            self._joining.update(asked)
        return asked

    def _acked(self, generation: int) -> set[str]:
        self._read_inbox()
        return self._acks.get(generation, set())

    def _regroup(self, resend: int | None, payload: Mapping[str, torch.Tensor] | None = None) -> None:
        """Form the next group with the members and the joiners, then re-send ``resend`` into it
        (from ``payload``, or the current weights), by filesystem too for producers on that method."""
        assert self.former is not None and self.membership is not None and self.filesystem is not None
        joining, self._joining = list(self._joining), {}
        for producer in joining:
            self._tried[producer] = self.last_version
        if self.sender is not self.filesystem:
            self.sender.close()  # the old group: every member leaves it for the new one
        sender, self.membership, attempts = self.former.form(
            self.membership.next(add=joining), self._announce_group, self._acked
        )
        for attempt in attempts:
            GROUP_REFORMS.labels(outcome="ok" if attempt.ok else "failed").inc()
        self._read_inbox()  # a member's request sent before it acknowledged this group is answered by it
        for producer in self._acks.get(self.membership.generation, set()) & set(self.membership.members):
            self._joining.pop(producer, None)
        self._acks = {g: a for g, a in self._acks.items() if g > self.membership.generation}
        self.sender = sender if sender is not None else self.filesystem
        self._count_members()
        if resend is not None:
            self._publish(resend, self._payload(resend) if payload is None else payload)

    def _recover(self, version: int, exc: BaseException, payload: Mapping[str, torch.Tensor] | None) -> None:
        """A send of ``version`` failed: re-form the group and re-send it; without a former, fall
        back for the rest of the run."""
        if self.former is not None and self.sender is not self.filesystem:
            log.error(
                "%s of weights version %d failed (%s: %s); re-forming the weight group",
                self.sender.method,
                version,
                type(exc).__name__,
                exc,
            )
            self._regroup(version, payload)
            return
        self._fall_back(version, exc)
        self._publish(version, self._payload(version) if payload is None else payload)

    def _announce_group(self, membership: Membership, host: str, port: int) -> None:
        self._send_message(
            WeightGroup(
                id=new_id(),
                generation=membership.generation,
                host=host,
                port=port,
                members=list(membership.members),
                filesystem=list(membership.filesystem),
            )
        )

    def _count_members(self) -> None:
        counts = dict.fromkeys(WEIGHT_METHODS, 0)
        if self.membership is None:  # no group management: every producer takes the method in use
            counts[self.method] = self._num_members
        else:  # the group's members by broadcast (unless the group is gone), the others by the fallback
            assert self.filesystem is not None
            in_group = 0 if self.sender is self.filesystem else len(self.membership.members)
            counts["broadcast"] = in_group
            counts[self.filesystem.method] += len(self.membership.filesystem) + len(self.membership.members) - in_group
        for method, count in counts.items():
            WEIGHT_MEMBERS.labels(method=method).set(count)

    # -- sending ---------------------------------------------------------------------------------

    def _payload(self, version: int) -> Mapping[str, torch.Tensor]:
        return self.payload(version, adapter=self.adapter and self.sender.carries_adapter)

    def _publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Send ``state`` as ``version`` by the method in use, and by filesystem for the producers
        on it."""
        if self.sender is not self.filesystem:
            self.sender.publish(state, version, self._announce, build_manifest(state, self.dtype))
            if self.membership is None or not self.membership.filesystem:
                return
        self._publish_filesystem(version, state)

    def _publish_filesystem(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Write and announce ``version`` by filesystem; a version it wrote last is re-announced."""
        assert self.filesystem is not None
        if self._fs_last is not None and self._fs_last["version"] == version:
            self._announce(self._fs_last)
            return
        self._fs_last = self.filesystem.publish(state, version, self._announce, build_manifest(state, self.dtype))

    def _announce(self, info: dict) -> None:
        self._send_message(
            WeightsReady(
                id=new_id(),
                version=info["version"],
                method=info["method"],
                manifest=info["manifest"],
                path=info["path"] or "",
                num_bytes=info["num_bytes"],
            )
        )

    def _fall_back(self, version: int, exc: BaseException) -> None:
        """Replace the failed sender by the fallback for the rest of the run."""
        assert self.fallback is not None
        BROADCAST_FALLBACKS.inc()
        log.error(
            "%s of weights version %d failed (%s: %s); sending weights through %s from now on",
            self.sender.method,
            version,
            type(exc).__name__,
            exc,
            self.fallback,
        )
        broken, self.sender, self.fallback = self.sender, self.fallback, None
        broken.close()
        self._count_members()
