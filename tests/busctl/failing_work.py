"""A real component for the failure tests of ``busctl up``: it scores one made-up group after another with a
real :class:`rewards.worker.RewardWorker` (isolated children) whose reward functions fail, and reports the
failure shares in its heartbeats like a reward worker. While ``RUN_DIR/fail-setup-NAME`` exists, ``setup()``
raises instead, with the file's text as the message (a component that fails while starting)."""

from __future__ import annotations

import numpy as np

from bus.component import Component, component_main
from bus.messages import RolloutGroup
from rewards.worker import RewardWorker
from telemetry.failure_window import FailureWindows

FNS = "tests.rewards.reward_fns"
TEXTS = ["raise", "fine", "good", "well"]  # by_text raises on the first: 25% of its calls fail


def group(texts: list[str]) -> RolloutGroup:
    g, lens = len(texts), [len(t) for t in texts]
    return RolloutGroup(
        id="grp",
        prompt_index=0,
        step=0,
        task="reverse_text",
        info={"target": "x"},
        producer="producer-0",
        completion_texts=list(texts),
        finish_reasons=["stop"] * g,
        gen_time_s=0.0,
        prompt_ids=np.arange(4, dtype=np.int32),
        completion_ids=np.arange(sum(lens), dtype=np.int32),
        completion_lens=np.array(lens, np.int32),
        sampler_logprobs=np.zeros(sum(lens), np.float32),
        version_start=np.zeros(g, np.int64),
        version_end=np.zeros(g, np.int64),
    )


class FailingScorer(Component):
    """Scores :data:`TEXTS` with ``by_text`` (fails on 25% of calls) and ``raises`` (fails on all) every 20 ms."""

    def setup(self) -> None:
        marker = self.run_dir / f"fail-setup-{self.name}"
        if marker.exists():
            raise ValueError(marker.read_text())
        r = self.cfg.rewards
        self.failures = FailureWindows(
            window=r.error_window, warn_fraction=r.warn_error_fraction, max_fraction=r.max_error_fraction
        )
        spec = {"reverse_text": [(f"{FNS}:by_text", 1.0), (f"{FNS}:raises", 1.0)]}
        self.worker = RewardWorker(spec, name=self.name, num_procs=1, failures=self.failures)

    def run(self) -> None:
        rollout = group(TEXTS)
        while not self.stop.wait(0.02):
            self.worker.score(rollout)

    def close(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(FailingScorer))
