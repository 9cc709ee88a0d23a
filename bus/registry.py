"""The registries of message types: which types the codec encodes and decodes
(:data:`MESSAGE_TYPES`) and which the control hub forwards (:data:`CONTROL_TYPES`).

They live apart from :mod:`bus.messages` so that message modules beside it
(:mod:`bus.messages_weights`, ...) can add types without an import cycle: every message module
imports :class:`bus.messages.Message`, this module imports them all.

Invariants: every ``TYPE`` string names exactly one class; a type is registered here or it raises
in :mod:`bus.codec`.
"""

from __future__ import annotations

from bus.messages import (
    ComponentHeartbeat,
    ComponentReady,
    EvalResult,
    GroupsDropped,
    GroupsTrained,
    Message,
    MicroBatch,
    Prompt,
    RolloutGroup,
    RunDone,
    ScoredGroup,
    TrainerStep,
    WeightsApplied,
    WeightsReady,
    WeightsWanted,
)
from bus.messages_weights import WEIGHT_GROUP_TYPES, WEIGHT_TRANSFER_TYPES

CONTROL_TYPES: tuple[type[Message], ...] = (
    WeightsReady,
    WeightsApplied,
    WeightsWanted,
    TrainerStep,
    GroupsDropped,
    GroupsTrained,
    RunDone,
    EvalResult,
    *WEIGHT_GROUP_TYPES,
)
"""The message types the control channel carries (the hub forwards nothing else)."""

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        *CONTROL_TYPES,
        Prompt,
        RolloutGroup,
        ScoredGroup,
        MicroBatch,
        ComponentReady,
        ComponentHeartbeat,
        *WEIGHT_TRANSFER_TYPES,
    )
}
"""Every message type by its ``TYPE`` string: what :mod:`bus.codec` encodes and decodes."""
if len(MESSAGE_TYPES) != len(CONTROL_TYPES) + 6 + len(WEIGHT_TRANSFER_TYPES):
    raise RuntimeError("two message classes share a TYPE string")
