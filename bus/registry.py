"""The registries of message types: :data:`MESSAGE_TYPES` (by ``TYPE``, what :mod:`bus.codec` takes) and
:data:`CONTROL_TYPES` (what the hub forwards). Apart from :mod:`bus.messages` so that message modules beside
it can add types without an import cycle. Every ``TYPE`` names exactly one class.
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
    RunFinalStep,
    RunFinish,
    ScoredGroup,
    ServersScaled,
    ServersWanted,
    TrainerStep,
    WeightsApplied,
    WeightsReady,
    WeightsWanted,
)
from bus.messages_api import API_TYPES
from bus.messages_weights import WEIGHT_GROUP_TYPES, WEIGHT_TRANSFER_TYPES

CONTROL_TYPES: tuple[type[Message], ...] = (
    WeightsReady,
    WeightsApplied,
    WeightsWanted,
    TrainerStep,
    GroupsDropped,
    GroupsTrained,
    RunDone,
    RunFinish,
    RunFinalStep,
    EvalResult,
    ServersWanted,
    ServersScaled,
    *WEIGHT_GROUP_TYPES,
)


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
        *API_TYPES,
    )
}
if len(MESSAGE_TYPES) != len(CONTROL_TYPES) + 6 + len(WEIGHT_TRANSFER_TYPES) + len(API_TYPES):
    raise RuntimeError("two message classes share a TYPE string")
