"""The two sides of one weight-transfer method: `WeightSender` (trainer) and `WeightReceiver` (producer).
One module per method holds both sides (`dist_broadcast`, `filesystem`, `bus_method`); `broadcaster.factory` picks
them by `broadcast.method`. A sender's `publish` announces and sends in the order its method needs (broadcast:
announce first, producers join the collective on it; filesystem: write first), through a callback, so a sender
never touches the bus. An announcement is `{"method", "version", "manifest", "path", "num_bytes"}`, what
`bus.messages.WeightsReady` carries (`path` only for the filesystem method). A receiver takes its method's only.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from broadcaster.manifest import build_manifest

Announce = Callable[[dict], None]
"""Called by `WeightSender.publish` with one version's announcement."""


class SendFailed(RuntimeError):
    """A background weight transfer failed (a producer died, a gloo/nccl error or timeout).
    `version` failed; `payload` `{name: tensor}` (views of the send buffers) lets it be re-published another way."""

    def __init__(self, version: int, payload: dict[str, torch.Tensor], cause: BaseException) -> None:
        super().__init__(f"broadcast of weights version {version} failed: {type(cause).__name__}: {cause}")
        self.version = version
        self.payload = payload


class WeightSender(ABC):
    """Trainer side of one method: hands a payload `{hf_name: tensor}` to the producers.
    `method`: the `broadcast.method` value; `carries_adapter`: whether it may carry a LoRA adapter payload."""

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
        """Start sending `state_dict` as `version`; returns the announcement plus `bucket_bytes`, `blocked_s`.

        `manifest` (None: built here) names the entries and their wire dtypes (tensors are cast on the way)."""

    def wait(self) -> dict | None:
        """Wait for the transfer in flight; its info (with `transfer_s`) or None. Raises `SendFailed`."""
        return None

    def transfer_finished(self) -> bool:
        """True if a background transfer is in flight and done (`wait` returns at once)."""
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
        """Send and `announce` `version` in the order this method needs; returns `start_send`'s info."""
        info = self.start_send(state_dict, version, manifest)
        announce(info)
        return info

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict:
        """`start_send` + `wait`: `start_send`'s dict plus `send_time_s` (and `transfer_s` if backgrounded)."""
        start = time.perf_counter()
        info = self.start_send(state_dict, version)
        done = self.wait()
        return {**info, **(done or {}), "send_time_s": time.perf_counter() - start}

    @staticmethod
    def manifest(state_dict: Mapping[str, torch.Tensor]) -> list[list]:
        """`[[hf_name, dtype, shape], ...]` in send order (see `broadcaster.manifest`)."""
        return build_manifest(state_dict)


class WeightReceiver(ABC):
    """Producer side of one method: applies `weights.ready` to a `producers.engine.RolloutEngine`."""

    method: ClassVar[str]

    async def join(self) -> None:
        """Get ready to receive (the broadcast method joins its group here; blocks). Default: nothing."""

    def skip_reason(self, msg: Any, current_version: int) -> str | None:
        """Why `msg` (a `WeightsReady` of this method) cannot be applied at `current_version`, or None."""
        return None

    def must_apply(self, msg: Any, current_version: int) -> bool:
        """Whether `msg` must be applied though the engine has `msg.version` (a re-formed group's first send)."""
        return False

    @property
    def wants_group(self) -> bool:
        """Whether to ask the trainer (`WeightsWanted`) to re-form the weight group with this producer."""
        return False

    async def regroup(self, msg: Any, ack: Callable[[], None]) -> bool:
        """Act on a re-formed `WeightGroup` (`ack` acknowledges membership); whether this receiver is in it."""
        return False

    def lost_group(self) -> bool:
        """Whether the engine just left the weight group on its own (an inference server restarted); the receiver
        then wants one (`wants_group`). Polled by the producer. Default: never."""
        return False

    @abstractmethod
    async def apply(self, msg: Any) -> int | None:
        """Load `msg`'s weights; the version loaded when not `msg.version` (bus: the latest), else None."""


class FallbackReceiver(WeightReceiver):
    """`primary`'s receiver that also takes `fallback`'s announcements (`trainer.publish` falls back).
    `skip_reason` / `apply` raise ValueError for a method neither takes."""

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

    def lost_group(self) -> bool:
        return self.primary.lost_group()

    async def apply(self, msg: Any) -> int | None:
        return await self._for(msg).apply(msg)
