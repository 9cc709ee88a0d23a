"""The two sides of one weight-transfer method: `WeightSender` (trainer) and `WeightReceiver`
(producer process).

Each method has one module holding both sides (`broadcaster.dist_broadcast`: torch.distributed
broadcast; `broadcaster.filesystem`: a safetensors directory + READY marker;
`broadcaster.bus_method`: bucket frames pulled over the bus), and
`broadcaster.factory` is the one place that picks them by `broadcast.method`. A LoRA adapter is
not a method: it is a payload kind (`broadcaster.manifest`) that either method carries and the
vLLM worker extension (`broadcaster.worker_extension`) merges, so it has no sender of its own.

Invariants:
- A sender's `publish` announces and sends one version in the order its method needs: the
  broadcast method announces first (producers join the collective on the announcement), the
  filesystem method writes first (a producer acting on the announcement finds the directory
  complete). The caller supplies the announcement as a callback, so a sender never touches the bus.
- Every announcement is a dict `{"method", "version", "manifest", "path", "num_bytes"}`
  (`path` None except for the filesystem method): what `bus.messages.WeightsReady` carries.
- A receiver takes the announcements of its `method` (`WeightsReady.method`) only.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from broadcaster.manifest import build_manifest

Announce = Callable[[dict], None]
"""Called by `WeightSender.publish` with the announcement of one version (see the module docstring)."""


class SendFailed(RuntimeError):
    """A background weight transfer failed (a producer died, a gloo/nccl error or timeout).

    Attributes:
        version: the policy version whose transfer failed.
        payload: `{name: tensor}` that version's payload (views of the send buffers, kept alive by
            this exception), so it can be re-published another way.
    """

    def __init__(self, version: int, payload: dict[str, torch.Tensor], cause: BaseException) -> None:
        super().__init__(f"broadcast of weights version {version} failed: {type(cause).__name__}: {cause}")
        self.version = version
        self.payload = payload


class WeightSender(ABC):
    """Trainer side of one method: hands a payload `{hf_name: tensor}` to the producers.

    Subclasses set `method` (the `broadcast.method` value and `WeightsReady.method` they stand for)
    and `carries_adapter` (whether `broadcast.lora_payload: adapter` applies to them, i.e. whether
    the trainer may hand them a LoRA adapter payload instead of merged weights).
    """

    method: ClassVar[str]
    carries_adapter: ClassVar[bool] = False

    def __str__(self) -> str:
        return f"the {self.method} method"

    def open(self) -> None:
        """Get ready to send (the broadcast method forms its group here; blocks). Default: nothing."""

    @abstractmethod
    def start_send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, manifest: list[list] | None = None
    ) -> dict:
        """Start sending `state_dict` as policy `version`; returns its info dict (the announcement's
        keys plus `bucket_bytes`, `blocked_s`). See the subclasses for what "start" means.

        `manifest` (None: `self.manifest(state_dict)`) names the entries to send and their wire
        dtypes: each tensor is cast to its entry's dtype on the way (`broadcaster.manifest`)."""

    def wait(self) -> dict | None:
        """Wait for the transfer in flight; returns its info (with `transfer_s`) or None if there is
        none. Raises `SendFailed` for a background transfer that failed. Default: nothing in flight."""
        return None

    def transfer_finished(self) -> bool:
        """True if a background transfer is in flight and done (`wait` returns at once). Default: False."""
        return False

    def close(self) -> None:
        """Release what `open` and the transfers hold (idempotent). Default: nothing."""

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        announce: Announce,
        manifest: list[list] | None = None,
    ) -> dict:
        """Send `state_dict` as `version` and `announce` it, in the order this method needs (the
        module docstring); returns `start_send`'s info. `manifest`: as for `start_send` (its
        dtypes are the wire dtypes; None: `self.manifest(state_dict)`). Raises as `start_send`."""
        info = self.start_send(state_dict, version, manifest)
        announce(info)
        return info

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict:
        """Send `state_dict` as policy `version` and wait until it is out (`start_send` + `wait`).

        Returns `start_send`'s dict plus `send_time_s` (the whole call) and, for a background
        transfer, `transfer_s`. Raises as `start_send`, and `SendFailed` for this version too.
        """
        start = time.perf_counter()
        info = self.start_send(state_dict, version)
        done = self.wait()
        return {**info, **(done or {}), "send_time_s": time.perf_counter() - start}

    @staticmethod
    def manifest(state_dict: Mapping[str, torch.Tensor]) -> list[list]:
        """`[[hf_name, dtype, shape], ...]` in send order (see `broadcaster.manifest`)."""
        return build_manifest(state_dict)


class WeightReceiver(ABC):
    """Producer side of one method: applies `weights.ready` announcements to a rollout engine.

    `engine` is a `producers.engine.RolloutEngine` (anything with its `update_weights`,
    `load_weights_from_path`, `init_weight_group` coroutines). Subclasses set `method`.
    """

    method: ClassVar[str]

    async def join(self) -> None:
        """Get ready to receive (the broadcast method joins its group here; blocks). Default: nothing."""

    def skip_reason(self, msg: Any, current_version: int) -> str | None:
        """Why announcement `msg` (a `bus.messages.WeightsReady` of this method) cannot be applied
        by this receiver at `current_version`, or None if it can. Default: always applicable."""
        return None

    def must_apply(self, msg: Any, current_version: int) -> bool:
        """Whether `msg` must be applied even though the engine already has `msg.version` (the
        first broadcast into a re-formed group). Default: False."""
        return False

    @property
    def wants_group(self) -> bool:
        """Whether this producer should ask the trainer (`bus.messages.WeightsWanted`) to re-form
        the weight group with it: outside every group and never placed on the filesystem method
        by one. Default (methods without a group): False."""
        return False

    async def regroup(self, msg: Any, ack: Callable[[], None]) -> bool:
        """Act on a re-formed group (`bus.messages_weights.WeightGroup`); `ack` acknowledges
        membership. Returns whether this receiver is in it. Default (no group): False."""
        return False

    @abstractmethod
    async def apply(self, msg: Any) -> int | None:
        """Load the weights `msg` announces into the engine; returns the version loaded when it is
        not `msg.version` (the bus method serves its latest), else None."""


class FallbackReceiver(WeightReceiver):
    """A receiver of `primary`'s method that also takes the announcements of `fallback`'s (the
    trainer falls back from the broadcast method to the filesystem one; see `trainer.publish`).

    Raises (from `skip_reason` / `apply`) ValueError for a method neither takes.
    """

    def __init__(self, primary: WeightReceiver, fallback: WeightReceiver) -> None:
        self.method = primary.method
        self.primary, self.fallback = primary, fallback
        self._by_method = {fallback.method: fallback, primary.method: primary}

    def _for(self, msg: Any) -> WeightReceiver:
        receiver = self._by_method.get(msg.method)
        if receiver is None:
            raise ValueError(f"weights.ready of method {msg.method!r}: this producer takes {sorted(self._by_method)}")
        return receiver

    async def join(self) -> None:
        await self.primary.join()

    def skip_reason(self, msg: Any, current_version: int) -> str | None:
        return self._for(msg).skip_reason(msg, current_version)

    def must_apply(self, msg: Any, current_version: int) -> bool:
        return self._for(msg).must_apply(msg, current_version)

    @property
    def wants_group(self) -> bool:
        return self.primary.wants_group

    async def regroup(self, msg: Any, ack: Callable[[], None]) -> bool:
        return await self.primary.regroup(msg, ack)

    async def apply(self, msg: Any) -> int | None:
        return await self._for(msg).apply(msg)
