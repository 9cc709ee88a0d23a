"""Weight publication of the trainer process: what the producers receive after each step, and how.

`WeightPublishing` is a mixin of `trainer.proc.TrainerProc` (it uses the process's `cfg`, `model`,
`control` publisher, `broadcaster` and `weights_dir`). Per version: wait for the previous
broadcast's transfer, announce `weights.ready`, then hand the payload to the broadcaster, whose
bytes move in the background (`broadcaster.WeightBroadcaster.start_send`); a failed broadcast
switches the process to the filesystem method for the rest of the run and re-publishes that
version through it. The payload is the merged full weights or, for LoRA with
`broadcast.lora_payload: adapter`, only the adapter; with `broadcast.noise_scheduler.enabled` the
RMSNorm weights sent carry QeRL noise while the trainer's own weights stay clean.
"""

from __future__ import annotations

import logging
import time

import torch
from prometheus_client import Counter, Histogram

from broadcaster.broadcaster import SendFailed, WeightBroadcaster
from broadcaster.manifest import manifest_num_bytes
from broadcaster.noise import is_rmsnorm_weight, qerl_noise_sigma, with_rmsnorm_noise
from bus.messages import WeightsReady, new_id
from trainer.model import lora_adapter_state_dict, policy_state_dict

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


class WeightPublishing:
    """Publishing of new policy weights for :class:`trainer.proc.TrainerProc` (module docstring)."""

    def filesystem_broadcaster(self) -> WeightBroadcaster:
        """A broadcaster that writes ``RUN_DIR/weights/v{N}`` (the method after a restart)."""
        return WeightBroadcaster(method="filesystem", out_dir=self.weights_dir)

    def publish_weights(self, version: int) -> float:
        """Announce and send the weights of ``version``; returns the seconds the trainer thread
        spent here (a broadcast's bytes move in the background).

        Broadcast: wait for the previous version's transfer (normally done long ago), announce
        ``weights.ready``, then copy :meth:`weights_payload` into the broadcaster's send buffers and
        hand it to the backend (``WeightBroadcaster.start_send``): the trainer goes on with the next
        step while the producers receive. A transfer that fails (at once, or seen by the next
        publish's wait) switches the trainer to the filesystem method for good and re-publishes the
        failed version that way: a background one from its send buffers (so in the payload it was
        broadcast in, an adapter with LoRA: producers load both kinds), one that failed at once
        from the current weights (see the module docstring). Filesystem: merged weights, written,
        then announced.
        """
        started = time.perf_counter()
        self.settle_weights()
        if self.broadcaster.method == "broadcast":
            adapter = self.cfg.trainer.lora.enabled and self.cfg.broadcast.lora_payload == "adapter"
            state = self.weights_payload(version, adapter=adapter)
            manifest = self.broadcaster.manifest(state)
            num_bytes = manifest_num_bytes(manifest)
            self.control.send(WeightsReady(id=new_id(), version=version, method="broadcast", manifest=manifest, path="", num_bytes=num_bytes))
            try:
                self.broadcaster.start_send(state, version, manifest)
            except RuntimeError as exc:  # torch.distributed errors (DistBackendError, timeouts) are RuntimeErrors
                self.fall_back_to_filesystem(version, exc)
        if self.broadcaster.method == "filesystem":
            self.write_weights(version, self.weights_payload(version, adapter=False))
        elapsed = time.perf_counter() - started
        BROADCAST_SECONDS.observe(elapsed)
        return elapsed

    def settle_weights(self) -> None:
        """Wait for the broadcast in flight (if any) to reach every producer; if it failed, switch
        to the filesystem method and re-publish its version from its send buffers. Records the
        transfer's duration (``rlbus_trainer_weight_transfer_seconds``)."""
        if self.broadcaster.method != "broadcast":
            return
        try:
            done = self.broadcaster.wait()
        except SendFailed as exc:
            self.fall_back_to_filesystem(exc.version, exc)
            self.write_weights(exc.version, exc.payload)
            return
        if done and done.get("transfer_s") is not None:
            TRANSFER_SECONDS.observe(done["transfer_s"])

    def write_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Filesystem method: write ``state`` as ``version`` and announce it."""
        info = self.broadcaster.send(state, version)
        self.control.send(
            WeightsReady(id=new_id(), version=version, method="filesystem", manifest=info["manifest"], path=info["path"], num_bytes=info["num_bytes"])
        )

    def weights_payload(self, version: int, *, adapter: bool) -> dict[str, torch.Tensor]:
        """What the producers get as ``version``: the merged full weights
        (:func:`trainer.model.policy_state_dict`), or with ``adapter`` only the LoRA adapter
        (:func:`trainer.model.lora_adapter_state_dict`; with the noise scheduler on, the RMSNorm
        weights travel whole alongside it). With ``broadcast.noise_scheduler.enabled`` the RMSNorm
        weights in it are fresh noisy copies (QeRL, :mod:`broadcaster.noise`, stage of ``version``
        over ``trainer.max_steps``); the trainer's own weights stay clean."""
        noise = self.cfg.broadcast.noise_scheduler
        if adapter:
            state = lora_adapter_state_dict(self.model, include=is_rmsnorm_weight if noise.enabled else None)
        else:
            state = policy_state_dict(self.model)
        if not noise.enabled:
            return state
        sigma = qerl_noise_sigma(version, self.cfg.trainer.max_steps, sigma_start=noise.sigma_start,
                                 sigma_end=noise.sigma_end, num_stages=noise.num_stages)
        return with_rmsnorm_noise(state, sigma, seed=noise.seed, version=version)

    def fall_back_to_filesystem(self, version: int, exc: BaseException) -> None:
        """Replace the broken broadcast group by the filesystem method, for the rest of the run
        (``version``: the version whose transfer failed, for the log)."""
        BROADCAST_FALLBACKS.inc()
        log.error("broadcast of weights version %d failed (%s: %s); sending weights through %s from now on",
                  version, type(exc).__name__, exc, self.weights_dir)
        broken, self.broadcaster = self.broadcaster, self.filesystem_broadcaster()
        broken.close()
