"""The packer process: PULL ``scored`` (bound) -> :class:`packer.packer.Packer` -> PUSH ``batches``.

Dropped groups are announced on the control channel (:class:`bus.messages.GroupsDropped`) so the
prompt source issues replacements. Sending a step blocks at the small ``batches`` HWM, which
stops this loop from pulling ``scored``, which in turn blocks the reward workers: the trainer's
pace propagates upstream.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from bus.component import Component, component_main
from bus.messages import GroupsDropped, RunDone, ScoredGroup, new_id
from packer.packer import Packer

log = logging.getLogger(__name__)

GROUPS_IN = Counter("rlbus_packer_groups_total", "Scored groups received, by outcome", ["outcome"])
STEPS_OUT = Counter("rlbus_packer_steps_total", "Optimizer steps emitted")
MICRO_BATCHES = Gauge("rlbus_packer_micro_batches", "Micro-batches in the last emitted step")
BUFFERED = Gauge("rlbus_packer_buffered_groups", "Groups waiting for the next step")


class PackerProc(Component):
    """Process wrapper of :class:`Packer`."""

    def setup(self) -> None:
        cfg = self.cfg
        self.packer = Packer(cfg.prompts_per_step, cfg.packer.max_off_policy_steps, cfg.packer.micro_batch_tokens)
        self.scored = self.socket("scored", "recv", self.endpoints.address("scored"), bind=True, accept=(ScoredGroup,))
        self.batches = self.socket("batches", "send", self.endpoints.address("batches"), bind=True)
        self.control_out = self.control_publisher()
        self.control_in = self.control_subscriber()

    def _announce_dropped(self, groups: list[ScoredGroup], reason: str) -> None:
        if groups:
            GROUPS_IN.labels(reason).inc(len(groups))
            log.info("dropped %d group(s) as %s", len(groups), reason)
            self.control_out.send(GroupsDropped(id=new_id(), group_ids=[g.id for g in groups], reason=reason))

    def run(self) -> None:
        while not self.stop.is_set():
            if isinstance(self.control_in.recv(timeout_s=0), RunDone):
                return
            group = self.scored.recv(timeout_s=0.2)
            if group is not None:
                accepted, reason = self.packer.add(group)
                if accepted:
                    GROUPS_IN.labels("accepted").inc()
                elif reason != "duplicate":
                    self._announce_dropped([group], reason)
            batches, dropped = self.packer.pop_step()
            self._announce_dropped(dropped, "stale")
            BUFFERED.set(len(self.packer.buffer))
            if batches:
                MICRO_BATCHES.set(len(batches))
                for mb in batches:
                    if not self.batches.send(mb):
                        return  # stopped while blocked at the HWM
                STEPS_OUT.inc()
                log.info("step %d: %d micro-batch(es), %d loss tokens", batches[0].step, len(batches), batches[0].step_loss_tokens)


if __name__ == "__main__":
    raise SystemExit(component_main(PackerProc))
