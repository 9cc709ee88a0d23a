"""The trainer process: PULL ``batches`` -> optimizer step -> weights to the producers.

Per step ``s`` (0-based; the weights in use have policy version ``s``):

1. receive the step's ``num_micro_batches`` micro-batches (forward/backward as each arrives);
2. clip and step AdamW (:class:`trainer.trainer.Trainer`); the policy is now version ``s + 1``;
3. announce ``weights.ready(s + 1)`` and send the weights (broadcast: announce first, since the
   collective blocks until every producer joins; filesystem: write, then announce);
4. publish ``trainer.step``, append one line to ``metrics.jsonl`` and the step's sample ids and
   versions to ``trained_samples.jsonl`` (the record that every sample trained exactly once);
   checkpoint to ``checkpoints/step_N`` every ``checkpoint_interval`` steps and after the last
   step (the trained policy of the run). Resuming from a checkpoint is not wired yet: it needs
   the packer to re-send unacknowledged steps (see docs/DELIVERY.md).

``eval_reward_mean`` is measured before the first step and after the last; then ``run.done`` is
published, which ends the run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import Gauge, Histogram
from transformers import AutoTokenizer

from broadcaster.broadcaster import WeightBroadcaster
from broadcaster.manifest import manifest_num_bytes
from bus.component import Component, component_main
from bus.messages import MicroBatch, RunDone, TrainerStep, WeightsReady, new_id
from bus.metrics import POLICY_VERSION
from producers.tasks import load_task_examples, render_messages
from rewards.registry import get_reward_fn
from trainer.checkpoint import save_checkpoint
from trainer.evaluate import eval_reward_mean
from trainer.model import load_policy, policy_state_dict
from trainer.trainer import Trainer

log = logging.getLogger(__name__)

STEP_SECONDS = Histogram("rlbus_trainer_step_seconds", "Wall time per optimizer step incl. waiting for data, seconds")
BROADCAST_SECONDS = Histogram("rlbus_trainer_weight_broadcast_seconds", "Time to send new weights, seconds")
TRAINER_GAUGES = {
    key: Gauge(f"rlbus_trainer_{key}", doc)
    for key, doc in {
        "reward_mean": "Mean reward of the last step's samples",
        "loss": "Loss of the last step",
        "kl": "Mean k3 KL(infer || train) estimate of the last step, nats",
        "masked_frac": "Fraction of loss tokens masked by the importance-ratio bounds",
        "grad_norm": "Gradient norm before clipping",
        "policy_lag_mean": "Mean off-policy lag of the last step's samples, steps",
        "tokens_per_s": "Trained tokens per second of wall time",
        "eval_reward_mean": "Mean reward on the held-out eval prompts",
    }.items()
}


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line to ``path``; non-finite floats (a skipped step's loss)
    become ``null`` so the file stays strict JSON."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean, allow_nan=False) + "\n")


class TrainerProc(Component):
    """Process wrapper of :class:`Trainer` with the weight broadcaster; its ``run.done`` after
    the last step is what ends the run."""

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.model = load_policy(cfg.model.path, cfg.trainer.lora)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.trainer = Trainer(self.model, cfg.trainer, cfg.sampling.temperature)
        self.batches = self.socket("batches", "recv", self.endpoints.address("batches"), bind=False, accept=(MicroBatch,))
        self.control = self.control_publisher()
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.eval_examples = load_task_examples(cfg.task.name, "eval", cfg.task.num_eval_examples, cfg.task.eval_seed)
        self.reward_fn = get_reward_fn(cfg.rewards.reward_fn or cfg.task.name)
        b = cfg.broadcast
        self.broadcaster = WeightBroadcaster(
            method=b.method,
            backend=b.backend,
            host=b.host,
            port=b.port,
            world_size=1 + cfg.producers.replicas,
            out_dir=self.run_dir / "weights",
            timeout_s=b.timeout_s,
        )
        if b.method == "broadcast":
            self.broadcaster.init_group()

    def evaluate(self, step: int) -> dict[str, float]:
        s = self.cfg.sampling
        result = eval_reward_mean(
            self.model,
            self.tokenizer,
            self.eval_examples,
            render_messages,
            self.reward_fn,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            num_samples=self.cfg.trainer.eval_num_samples,
            seed=self.cfg.trainer.seed,
        )
        TRAINER_GAUGES["eval_reward_mean"].set(result["eval_reward_mean"])
        append_jsonl(self.metrics_path, {"step": step, **result})
        log.info("eval at step %d: reward %.4f", step, result["eval_reward_mean"])
        return result

    def receive_step(self, step: int) -> list[MicroBatch] | None:
        """Collect step ``step``'s micro-batches; None if stopped first."""
        got: dict[int, MicroBatch] = {}
        expected = None
        while expected is None or len(got) < expected:
            mb = self.batches.recv(timeout_s=None)
            if mb is None:
                return None
            if mb.step != step:
                self.batches.reject("wrong_step", f"micro-batch of step {mb.step} while training step {step}")
                continue
            got.setdefault(mb.micro_index, mb)
            expected = mb.num_micro_batches
        return [got[i] for i in range(expected)]

    def publish_weights(self, version: int) -> float:
        """Announce and send the weights of ``version``; returns seconds spent."""
        started = time.perf_counter()
        state = policy_state_dict(self.model)
        if self.broadcaster.method == "broadcast":
            manifest = self.broadcaster.manifest(state)
            num_bytes = manifest_num_bytes(manifest)
            self.control.send(WeightsReady(id=new_id(), version=version, method="broadcast", manifest=manifest, path="", num_bytes=num_bytes))
            self.broadcaster.send(state, version)
        else:
            info = self.broadcaster.send(state, version)
            self.control.send(
                WeightsReady(id=new_id(), version=version, method="filesystem", manifest=info["manifest"], path=info["path"], num_bytes=info["num_bytes"])
            )
        elapsed = time.perf_counter() - started
        BROADCAST_SECONDS.observe(elapsed)
        return elapsed

    def save(self, step: int) -> None:
        """Checkpoint after ``step`` optimizer steps (weights or adapter, optimizer, RNG)."""
        path = save_checkpoint(
            self.run_dir / "checkpoints",
            step=step,
            model=self.model,
            optimizer=self.trainer.optimizer,
            extra={"policy_version": step},
            keep=self.cfg.trainer.checkpoint_keep,
        )
        log.info("checkpoint of step %d in %s", step, path)

    def run(self) -> None:
        max_steps = self.cfg.trainer.max_steps
        self.evaluate(0)
        last = time.perf_counter()
        step = 0
        while step < max_steps:
            micro_batches = self.receive_step(step)
            if micro_batches is None:
                log.info("stopped before step %d", step)
                return
            metrics = self.trainer.step(micro_batches)
            versions = np.concatenate([mb.versions for mb in micro_batches])
            lags = step - versions
            assert lags.max() <= self.cfg.packer.max_off_policy_steps, "the packer let a stale sample through"
            metrics["weight_sync_s"] = self.publish_weights(step + 1)
            now = time.perf_counter()
            metrics.update(
                policy_lag_mean=float(lags.mean()),
                policy_lag_max=float(lags.max()),
                step_time_s=now - last,
                tokens_per_s=metrics["num_tokens"] / max(now - last, 1e-9),
            )
            last = now
            step += 1
            POLICY_VERSION.set(step)
            STEP_SECONDS.observe(metrics["step_time_s"])
            for key, gauge in TRAINER_GAUGES.items():
                if key in metrics:
                    gauge.set(metrics[key])
            append_jsonl(self.metrics_path, {"step": step, **metrics})
            interval = self.cfg.trainer.checkpoint_interval
            if step == max_steps or (interval and step % interval == 0):
                self.save(step)
            append_jsonl(self.run_dir / "trained_samples.jsonl", {
                "step": step - 1,
                "sample_ids": [i for mb in micro_batches for i in mb.sample_ids],
                "versions": versions.tolist(),
            })
            self.control.send(TrainerStep(id=new_id(), step=step, version=step, metrics=metrics))
        final = self.evaluate(step)
        self.control.send(RunDone(id=new_id(), step=step, reason="max_steps"))
        log.info("done: %d steps, eval reward %.4f", step, final["eval_reward_mean"])

    def close(self) -> None:
        broadcaster = getattr(self, "broadcaster", None)
        if broadcaster is not None:
            broadcaster.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(TrainerProc))
