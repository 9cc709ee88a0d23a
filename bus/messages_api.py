"""The ``api`` topic of ``busctl serve`` (docs/service.md): the API process asks the trainer (or a producer) to
run one call of a training or sampling client (:class:`ApiCall`) and gets one :class:`ApiReply` back, matched by
``call_id``. Request/reply over ROUTER/DEALER, not custody: the API process owns the request ids, the ordering per
model and the retries; a call lost with a restarted trainer fails that request (the API answers it with an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bus.messages import Message
from bus.wire import WireError, array_field

ERROR_CATEGORIES = ("", "user", "server", "unknown")
"""``ApiReply.category``: "" when ok, else the Tinker SDK's ``RequestErrorCategory`` values."""


@dataclass(frozen=True, eq=False)
class ApiCall(Message):
    """One call of a client, API process -> trainer (topic ``api``).

    Fields:
        op: what to run (``create_model``, ``forward_backward``, ``optim_step``, ``save_weights``,
            ``load_weights``, ``get_info``, ``sample``, ...); model_id: the training client (or sampler) it acts on.
        body: the call's JSON-like arguments (``loss_fn``, ``loss_fn_config``, ``adam_params``, ``path``, ...;
            ``loss_inputs``: the names of ``loss_inputs``' rows).
        token_ids: ``[N] int64`` the data's model-input tokens, datum after datum; datum_lens: ``[D] int64``.
        loss_inputs: ``[K, N] float64`` one row per named loss input (target_tokens, weights, logprobs,
            advantages, ...), aligned with ``token_ids``; ``[0, 0]`` when the call has none.
    """

    TYPE: ClassVar[str] = "api.call"
    op: str
    model_id: str
    body: dict
    token_ids: np.ndarray = array_field("int64", optional=True)
    datum_lens: np.ndarray = array_field("int64", optional=True)
    loss_inputs: np.ndarray = array_field("float64", 2, optional=True)

    def check(self) -> None:
        if (self.datum_lens < 0).any() or int(self.datum_lens.sum()) != len(self.token_ids):
            raise WireError("inconsistent", "datum_lens must be >= 0 and sum to len(token_ids)")
        if self.loss_inputs.size and self.loss_inputs.shape[1] != len(self.token_ids):
            raise WireError("inconsistent", "loss_inputs must have one column per token")


@dataclass(frozen=True, eq=False)
class ApiReply(Message):
    """The answer to :class:`ApiCall` ``call_id``, trainer -> API process (topic ``api``).

    Fields:
        ok: it ran; else ``error`` (a message for the client) and ``category`` (``user``: the request was bad,
            ``server``: it failed here). body: the result's JSON-like fields (``metrics``, ``path``, ``outputs``:
            the names of ``outputs``' rows, ...). outputs: ``[K, N] float64`` per-token results (logprobs,
            elementwise_loss, ...) aligned with the call's tokens, or ``[0, 0]``.
    """

    TYPE: ClassVar[str] = "api.reply"
    call_id: str
    ok: bool
    error: str
    category: str
    body: dict
    outputs: np.ndarray = array_field("float64", 2, optional=True)

    def check(self) -> None:
        if self.category not in ERROR_CATEGORIES or self.ok != (self.category == ""):
            raise WireError("inconsistent", "category must be '' exactly when ok, else user/server/unknown")


API_TYPES: tuple[type[Message], ...] = (ApiCall, ApiReply)
