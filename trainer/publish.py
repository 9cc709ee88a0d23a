"""Weight publication of the trainer process: what the producers receive after each step, and how.

:class:`WeightPublisher` is a member of :class:`trainer.proc.TrainerProc` (``self.publisher``). It
holds the weight sender of the run's method (:func:`broadcaster.factory.build_senders`) and the
one it falls back to. Per version: wait for the previous transfer (``settle``), then
``sender.publish``, which announces ``weights.ready`` and sends in the order its method needs (the
broadcast method's bytes then move in the background). A failed broadcast, at once or seen by the
next ``settle``, swaps the sender for the fallback (the filesystem method) for the rest of the run
and re-publishes that version through it: that swap (``_fall_back``) is the only place the method
changes. The payload (:func:`weights_payload`) is the merged full weights or, for LoRA with
``broadcast.lora_payload: adapter`` and a sender that carries adapters, only the adapter; with
``broadcast.noise_scheduler.enabled`` the RMSNorm weights sent carry QeRL noise while the trainer's
own weights stay clean.

Dtype: the payload holds the trainer's float32 master weights; they travel in the producers' dtype
(``producers.dtype`` resolved by :func:`broadcaster.dtypes.resolve_producer_dtype`; bfloat16: half
the bytes). The publisher writes that dtype into the manifest (:func:`broadcaster.manifest.build_manifest`)
and the sender casts while it copies into its send buffers or writes the file, so no cast copy of
the whole model is ever held. LoRA factors stay float32 (see ``build_manifest``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch
from prometheus_client import Counter, Histogram

from broadcaster.base import SendFailed, WeightSender
from broadcaster.dtypes import resolve_producer_dtype
from broadcaster.manifest import build_manifest, parse_dtype
from broadcaster.noise import is_rmsnorm_weight, qerl_noise_sigma, with_rmsnorm_noise
from bus.messages import WeightsReady, new_id
from trainer.distributed import DataParallel
from trainer.model import lora_adapter_state_dict, policy_state_dict
from trainer.sharding import GatheredWeights, is_sharded

log = logging.getLogger(__name__)

BROADCAST_SECONDS = Histogram(
    "rlbus_trainer_weight_broadcast_seconds",
    "Time the trainer thread spends publishing new weights (a broadcast's bytes then move in the background), seconds",
)
TRANSFER_SECONDS = Histogram(
    "rlbus_trainer_weight_transfer_seconds", "Duration of a background weight broadcast, start to every producer received, seconds"
)
BROADCAST_FALLBACKS = Counter(
    "rlbus_trainer_broadcast_fallbacks_total",
    "Weight broadcasts that raised (a producer died, a gloo/nccl error); the trainer then uses the filesystem method",
)


def weights_payload(model: torch.nn.Module, cfg, version: int, *, adapter: bool,
                    dp: DataParallel | None = None) -> Mapping[str, torch.Tensor]:
    """What the producers get as ``version``: the merged full weights of ``model``
    (:func:`trainer.model.policy_state_dict`), or with ``adapter`` only its LoRA adapter
    (:func:`trainer.model.lora_adapter_state_dict`; with the noise scheduler on, the RMSNorm
    weights travel whole alongside it). With ``cfg.broadcast.noise_scheduler.enabled`` (``cfg``: the
    ``RunConfig``) the RMSNorm weights in it are fresh noisy copies (QeRL, :mod:`broadcaster.noise`,
    stage of ``version`` over ``trainer.max_steps``); ``model``'s own weights stay clean.

    A sharded model (``trainer.parallel: fsdp``, rank 0 of ``dp``) gives a
    :class:`trainer.sharding.GatheredWeights`: each tensor is gathered (with every rank, which
    ``dp`` tells) only when the sender reads it, so no rank holds the whole model at once.

    Raises:
        ValueError: a sharded model with the noise scheduler or without ``dp`` (see :mod:`trainer.sharding`).
    """
    noise = cfg.broadcast.noise_scheduler
    if is_sharded(model):
        if noise.enabled or dp is None:
            raise ValueError("sharded (trainer.parallel: fsdp) weights are sent without broadcast.noise_scheduler, by rank 0 of "
                             "the data-parallel group; disable the noise scheduler or use trainer.parallel: ddp")
        return GatheredWeights(model, dp.send_gather)
    if adapter:
        state = lora_adapter_state_dict(model, include=is_rmsnorm_weight if noise.enabled else None)
    else:
        state = policy_state_dict(model)
    if not noise.enabled:
        return state
    sigma = qerl_noise_sigma(version, cfg.trainer.max_steps, sigma_start=noise.sigma_start,
                             sigma_end=noise.sigma_end, num_stages=noise.num_stages)
    return with_rmsnorm_noise(state, sigma, seed=noise.seed, version=version)


def weights_dtype(cfg) -> torch.dtype:
    """The dtype the run's weights travel in: ``cfg.producers.dtype`` (``cfg``: the ``RunConfig``),
    "auto" resolved as the producers resolve it (bfloat16 with CUDA, float32 without;
    :func:`broadcaster.dtypes.resolve_producer_dtype`)."""
    return parse_dtype(resolve_producer_dtype(cfg.producers.dtype, cuda_available=torch.cuda.is_available()))


class WeightPublisher:
    """Publishes each new policy version to the producers through a swappable sender.

    Args:
        sender: the run's sender, opened (:func:`broadcaster.factory.build_senders`).
        fallback: the sender to switch to when ``sender`` fails (None: failures raise).
        announce: sends one ``weights.ready`` on the control channel.
        payload: ``payload(version, adapter=...) -> {hf_name: tensor}`` (:func:`weights_payload`).
        adapter: whether the run sends LoRA adapters where the sender carries them
            (``trainer.lora.enabled`` and ``broadcast.lora_payload: adapter``).
        dtype: the wire dtype of the floating-point weights (:func:`weights_dtype`); None: the
            payload tensors' own.
    """

    def __init__(self, sender: WeightSender, fallback: WeightSender | None, announce: Callable[[WeightsReady], None],
                 payload: Callable[..., Mapping[str, torch.Tensor]], *, adapter: bool,
                 dtype: torch.dtype | None = None) -> None:
        self.sender, self.fallback = sender, fallback
        self._send_message = announce
        self.payload = payload
        self.adapter = adapter
        self.dtype = dtype
        self.last_version: int | None = None
        """The version last handed to :meth:`publish` (None: none yet)."""

    @classmethod
    def for_run(cls, cfg, model: torch.nn.Module, sender: WeightSender, fallback: WeightSender | None,
                announce: Callable[[WeightsReady], None], dp: DataParallel | None = None) -> "WeightPublisher":
        """The publisher of a run (``cfg``: its ``RunConfig``) whose payloads are ``model``'s weights
        (:func:`weights_payload`; gathered with the ranks of ``dp`` when sharded), adapters where
        ``trainer.lora.enabled`` and ``broadcast.lora_payload: adapter``, sent in the producers' dtype
        (:func:`weights_dtype`)."""
        return cls(sender, fallback, announce,
                   lambda version, adapter: weights_payload(model, cfg, version, adapter=adapter, dp=dp),
                   adapter=cfg.trainer.lora.enabled and cfg.broadcast.lora_payload == "adapter",
                   dtype=weights_dtype(cfg))

    @property
    def method(self) -> str:
        """The method in use (``broadcast.method`` values; what checkpoints record)."""
        return self.sender.method

    def publish(self, version: int) -> float:
        """Announce and send the weights of ``version``; returns the seconds the trainer thread
        spent here (a broadcast's bytes move in the background).

        Waits for the previous version's transfer first (normally done long ago). A send that
        fails at once falls back and re-publishes ``version`` from the current weights.
        """
        started = time.perf_counter()
        self.settle()
        self.last_version = version
        try:
            self._publish(version, self._payload(version))
        except RuntimeError as exc:  # torch.distributed errors (DistBackendError, timeouts) are RuntimeErrors
            if self.fallback is None:
                raise
            self._fall_back(version, exc)
            self._publish(version, self._payload(version))
        elapsed = time.perf_counter() - started
        BROADCAST_SECONDS.observe(elapsed)
        return elapsed

    def settle(self) -> None:
        """Wait for the transfer in flight (if any) to reach every producer; if it failed, fall
        back and re-publish its version from its send buffers (so in the payload it was sent in,
        an adapter with LoRA: producers load both kinds). Records the transfer's duration
        (``rlbus_trainer_weight_transfer_seconds``)."""
        try:
            done = self.sender.wait()
        except SendFailed as exc:
            if self.fallback is None:
                raise
            self._fall_back(exc.version, exc)
            self._publish(exc.version, exc.payload)
            return
        if done and done.get("transfer_s") is not None:
            TRANSFER_SECONDS.observe(done["transfer_s"])

    def serve_late_joiner(self, producer: str, version: int) -> None:
        """A producer outside the weight group wants weights (``weights.wanted`` of ``version``):
        while still broadcasting, switch to the fallback (filesystem) now and re-publish the last
        published version there, so the late joiner loads it; nothing once already switched (its
        next filesystem publication serves it) or without a fallback or publication.

        A broadcast that completed just before a producer died leaves the restarted producer
        without that version and the trainer waiting for data that needs it; a failed send only
        triggers the switch on the next publication, which never comes (the deadlock this ends).
        """
        if self.fallback is None or self.last_version is None:
            return
        self.settle()  # a transfer in flight finishes (or fails and falls back) first
        if self.fallback is None:
            return
        version_now = self.last_version
        self._fall_back(version_now, RuntimeError(f"{producer} is not in the weight group (wanted version {version})"))
        self._publish(version_now, self._payload(version_now))

    def poll(self) -> None:
        """``settle`` if a background transfer has finished (does not block otherwise): a failed
        one falls back now, as a restarted producer waits for the filesystem re-publication."""
        if self.sender.transfer_finished():
            self.settle()

    def close(self) -> None:
        """Close the sender in use (waits for a transfer in flight; idempotent)."""
        self.sender.close()

    def _payload(self, version: int) -> Mapping[str, torch.Tensor]:
        return self.payload(version, adapter=self.adapter and self.sender.carries_adapter)

    def _publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        self.sender.publish(state, version, self._announce, build_manifest(state, self.dtype))

    def _announce(self, info: dict) -> None:
        self._send_message(WeightsReady(id=new_id(), version=info["version"], method=info["method"],
                                        manifest=info["manifest"], path=info["path"] or "", num_bytes=info["num_bytes"]))

    def _fall_back(self, version: int, exc: BaseException) -> None:
        """Replace the failed sender by the fallback for the rest of the run (``version``: the
        version whose transfer failed, for the log)."""
        assert self.fallback is not None
        BROADCAST_FALLBACKS.inc()
        log.error("%s of weights version %d failed (%s: %s); sending weights through %s from now on",
                  self.sender.method, version, type(exc).__name__, exc, self.fallback)
        broken, self.sender, self.fallback = self.sender, self.fallback, None
        broken.close()
