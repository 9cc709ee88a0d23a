"""What the web server of ``busctl serve`` holds between requests: the config, the keys, the promises
(:class:`service.futures.Futures`), the sessions and the trainer link; built on the event loop at start-up."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from bus.messages import new_id
from bus.messages_api import ApiCall
from configs.schema import RunConfig
from service.futures import Futures


@dataclass
class ServiceState:
    """``send``: hands a due call to the trainer (set once the link is open)."""

    cfg: RunConfig
    keys: frozenset[str]
    futures: Futures
    sessions: set[str] = field(default_factory=set)
    sampling_sessions: dict[str, dict] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None
    last_model: str = ""

    @property
    def served_models(self) -> list[str]:
        """The base models clients may name: ``model.path`` and ``serve.models``."""
        return [m for m in dict.fromkeys([self.cfg.model.path, *self.cfg.serve.models]) if m]

    def new_session(self) -> str:
        sid = f"s-{uuid.uuid4().hex[:12]}"
        self.sessions.add(sid)
        return sid

    def call(self, op: str, model_id: str, body: dict[str, Any], seq_id: int | None = None, **arrays: Any) -> str:
        """Submit one call to the trainer; returns its request id (an earlier copy's for a retry)."""
        msg = ApiCall(id=new_id(), op=op, model_id=model_id, body=body, **arrays)
        return self.futures.submit(msg, seq_id)


def training_model_id(session_id: str, model_seq_id: int) -> str:
    """The model id of a session's ``model_seq_id``-th training client (the SDK derives the same id)."""
    return f"{session_id}:train:{model_seq_id}"
