"""The batches of bench/gpu_trainer.py: a uniform and a GRPO-shaped batch as scored groups, fixed (the
same batch every step) or a seeded step sequence whose sample counts and lengths change every step, as
a real run's do (so ``trainer.compile``'s recompiles and the allocator's fragmentation show).

Uniform: distinct prompts, one sample per group, every sample prompt + completion of equal halves.
GRPO: ``GROUP`` completions of one prompt per group, lengths drawn uniformly. Sizes: ``SHAPES``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GROUP", "SHAPES", "make_groups", "samples_of", "step_batches"]

GROUP = 8
SHAPES = {
    # kind: (fixed batch, step-sequence ranges); smoke sizes in the "smoke_" entries
    "uniform": {"samples": 64, "half": 256, "seq_samples": (48, 80)},
    "smoke_uniform": {"samples": 16, "half": 16, "seq_samples": (8, 24)},
    "grpo": {"prompts": 8, "prompt": 256, "comp": (32, 1024), "seq_prompts": (6, 10), "seq_prompt": (128, 384)},
    "smoke_grpo": {"prompts": 2, "prompt": 32, "comp": (8, 64), "seq_prompts": (1, 2), "seq_prompt": (16, 48)},
}
"""Batch sizes in samples/tokens; ``seq_*`` are the inclusive ranges a step-sequence step draws from."""


def _build(comps: list[list[int]], prompt: int, shared: bool, vocab: int, rng: np.random.Generator, first=0) -> list:
    """Scored groups with random ids and advantages +-1: one group per entry of `comps` (its completion
    lengths) when `shared`, else one single-sample group per completion (distinct prompts)."""
    from tests.scored_groups import scored

    groups = []
    for g, lens in enumerate(comps, start=first):
        head = rng.integers(0, vocab, prompt)
        samples = []
        for n in lens:
            ids = np.concatenate([head if shared else rng.integers(0, vocab, prompt), rng.integers(0, vocab, int(n))])
            samples.append((ids[:prompt], ids[prompt:], float(rng.choice([-1.0, 1.0]))))
        units = [samples] if shared else [[s] for s in samples]
        for k, unit in enumerate(units):
            groups.append(
                scored(
                    f"g{g}" if shared else f"g{g}-{k}",
                    unit[0][0],
                    [c for _, c, _ in unit],
                    advantages=[a for _, _, a in unit],
                    rewards=[1.0] * len(unit),
                    logprobs=[np.full(len(c), -np.log(vocab), np.float32) for _, c, _ in unit],
                )
            )
    return groups


def make_groups(kind: str, vocab: int, smoke: bool, rng: np.random.Generator, sequence: bool = False) -> list:
    """One batch as scored groups. `sequence`: counts and lengths drawn from the ``seq_*`` ranges (a
    step of the step sequence); else the fixed batch. ValueError for an unknown `kind`."""
    if kind not in ("uniform", "grpo"):
        raise ValueError(f"unknown batch {kind!r}: uniform | grpo")
    s = SHAPES[f"smoke_{kind}" if smoke else kind]
    if kind == "uniform":
        n = int(rng.integers(s["seq_samples"][0], s["seq_samples"][1] + 1)) if sequence else s["samples"]
        comps = [[s["half"]] * GROUP for _ in range(n // GROUP)] + ([[s["half"]] * (n % GROUP)] if n % GROUP else [])
        return _build(comps, s["half"], False, vocab, rng)
    lo, hi = s["comp"]
    if not sequence:  # the draws in this order: the batch of the earlier runs in bench/README.md
        return _build(
            [list(rng.integers(lo, hi + 1, GROUP)) for _ in range(s["prompts"])], s["prompt"], True, vocab, rng
        )
    out = []
    for g in range(int(rng.integers(s["seq_prompts"][0], s["seq_prompts"][1] + 1))):  # a prompt length per group
        prompt = int(rng.integers(s["seq_prompt"][0], s["seq_prompt"][1] + 1))
        out += _build([list(rng.integers(lo, hi + 1, GROUP))], prompt, True, vocab, rng, first=g)
    return out


def step_batches(kind: str, vocab: int, smoke: bool, steps: int, sequence: bool, seed: int = 0) -> list[list]:
    """``steps + 1`` batches (the first is the warm-up): the fixed batch each time, or with `sequence`
    a new draw per step (seeded by `seed`, the same for every variant)."""
    rng = np.random.default_rng(seed)
    if not sequence:
        groups = make_groups(kind, vocab, smoke, rng)
        return [groups] * (steps + 1)
    return [make_groups(kind, vocab, smoke, rng, sequence=True) for _ in range(steps + 1)]


def samples_of(groups) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """``(prompt + completion ids, loss mask, advantage)`` of every sample, in group order."""
    from tests.scored_groups import sample_tokens

    return [(*sample_tokens(g, j), float(g.advantages[j])) for g in groups for j in range(g.group_size)]
