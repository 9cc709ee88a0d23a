"""The trainer process of ``busctl serve``: binds the ``api`` topic and runs each call of the API process on
:class:`trainer.api.engine.ApiEngine`, one at a time, in arrival order (the API process sends each model's
calls in ``seq_id`` order), answering each with its :class:`bus.messages_api.ApiReply`.
"""

from __future__ import annotations

import logging

import torch
from prometheus_client import Counter, Histogram

from bus.api_link import ApiServer
from bus.component import Component, component_main
from trainer.api.engine import ApiEngine

log = logging.getLogger(__name__)

CALLS = Counter("rlbus_trainer_api_calls_total", "API calls the trainer ran, by op and outcome", ["op", "outcome"])
CALL_SECONDS = Histogram(
    "rlbus_trainer_api_call_seconds",
    "Seconds the trainer spent on one API call, by op",
    ["op"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


class TrainerApiProc(Component):
    """The ``trainer`` component of a ``busctl serve`` run."""

    def setup(self) -> None:
        if self.cfg.trainer.num_threads:
            torch.set_num_threads(self.cfg.trainer.num_threads)
        self.engine = ApiEngine(self.cfg, self.run_dir)
        self.server = ApiServer(self.ctx, self.endpoints.address("api"))

    def run(self) -> None:
        while not self.stop.is_set():
            got = self.server.recv(timeout_s=0.2)
            if got is None:
                continue
            identity, call = got
            with CALL_SECONDS.labels(call.op).time():
                reply = self.engine.handle(call)
            CALLS.labels(call.op, "ok" if reply.ok else reply.category).inc()
            self.server.reply(identity, reply)

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(TrainerApiProc))
