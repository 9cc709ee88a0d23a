"""`Trainer.step` time on a CPU, against another source tree, interleaved run by run.

One run (a fresh interpreter, 1 torch thread, float32, the trainer config's defaults) builds the
default tiny policy (`policies.tiny_model.build_random_policy`), packs one step of GRPO groups with
the packer (`packer.packer.Packer`: add the groups, pop the step), takes one warm-up step and then
``--steps`` timed steps, and prints their median. Shapes:

- ``default``: the default job's (configs/reverse_text.yaml): 8 prompts of 40-47 tokens x 8
  completions of 1-16 tokens, 2048-token micro-batches;
- ``grpo``: 4 prompts of 128 tokens x 8 completions of 16-256 tokens, 4096-token micro-batches.

With ``--before DIR`` (an older tree, e.g. ``git archive COMMIT | tar -x -C DIR``) each of the
``--runs`` rounds runs that tree, then this one, so both see the same load on a shared host; the
table gives the median of the runs' medians.

    python -m bench.trainer_step_cpu [--shape default] [--runs 5] [--steps 9] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SHAPES = {  # prompts, group size, prompt length range, completion length range, micro-batch tokens
    "default": (8, 8, (40, 47), (1, 16), 2048),
    "grpo": (4, 8, (128, 128), (16, 256), 4096),
}

_ONE_RUN = r"""
import json, statistics, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
from configs.schema import LoraSection, OptimConfig, TrainerConfig
from bus.messages import ScoredGroup
from packer.packer import Packer
from policies.tiny_model import build_random_policy
from trainer.state.model import load_policy
from trainer.trainer import Trainer
prompts, group, (plo, phi), (clo, chi), budget = json.loads(sys.argv[1])
steps = int(sys.argv[2])
directory = Path(tempfile.mkdtemp())
build_random_policy(directory)
torch.manual_seed(0)
model = load_policy(str(directory), LoraSection(enabled=False))
rng = np.random.default_rng(0)
packer = Packer(prompts, 0, budget)
for g in range(prompts):
    prompt = rng.integers(0, model.config.vocab_size, int(rng.integers(plo, phi + 1)))
    comps, advantages = [], []
    for j in range(group):
        comps.append(rng.integers(0, model.config.vocab_size, int(rng.integers(clo, chi + 1))).astype(np.int32))
        advantages.append(float(rng.choice([-1.0, 1.0])))
    lens, zeros = np.array([len(c) for c in comps], np.int32), np.zeros(group, np.int64)
    packer.add(ScoredGroup(
        id=f"g{g}", prompt_index=g, step=0, task="t", info={}, producer="p", completion_texts=[""] * group,
        finish_reasons=["stop"] * group, gen_time_s=0.0, prompt_ids=prompt.astype(np.int32),
        completion_ids=np.concatenate(comps), completion_lens=lens,
        sampler_logprobs=np.full(int(lens.sum()), -5.0, np.float32), version_start=zeros, version_end=zeros,
        reward_worker="r", rewards=np.full(group, 0.5, np.float32), advantages=np.array(advantages, np.float32)))
micro_batches, _ = packer.pop_step()
trainer = Trainer(model, TrainerConfig(optim=OptimConfig(lr=1e-6)))
trainer.step(micro_batches)
times = []
for _ in range(steps):
    start = time.perf_counter()
    trainer.step(micro_batches)
    times.append(time.perf_counter() - start)
print(json.dumps({"median_s": statistics.median(times), "micro_batches": len(micro_batches)}))
"""


def one_run(tree: Path, shape: str, steps: int) -> float:
    """The median step seconds of one fresh-interpreter run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_RUN, json.dumps(SHAPES[shape]), str(steps)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["median_s"]


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=9, help="timed steps per run (after one warm-up)")
    parser.add_argument("--before", type=Path, default=None, help="an older source tree to time against, interleaved")
    args = parser.parse_args(argv)
    trees = {"before": args.before, "this tree": REPO_ROOT} if args.before else {"this tree": REPO_ROOT}
    results: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            results[name].append(one_run(tree, args.shape, args.steps))
    print("| tree | shape | runs | median step s | run medians |\n|---|---|---|---|---|")
    for name, medians in results.items():
        print(
            f"| {name} | {args.shape} | {len(medians)} | {statistics.median(medians):.3f} | "
            f"{', '.join(f'{m:.3f}' for m in medians)} |"
        )
    return results


if __name__ == "__main__":
    main()
