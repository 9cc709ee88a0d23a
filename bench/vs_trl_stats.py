"""Numbers of the rlbus-vs-TRL benchmark (:mod:`bench.vs_trl`): one arm's summary, the machine floor.

Both arms are reduced to one event list (epoch seconds, one clock): ``{"t", "kind": "step", "step",
"num_tokens", "completion_tokens"}`` (optimizer step ``step``, 1-based, done by ``t``) and ``{"t", "kind":
"eval", "step", "reward_mean"}`` (the eval after ``step`` steps). :func:`summarize_arm` gives steady-state
samples/s ``batch * (last - s0) / (t(last) - t(s0))`` with ``s0 = max(1, ceil(steady_skip * last))``, launch
to first step, launch to eval +delta, and the final eval. Floor (issue 14): a step costs ``6 N T_train + 2 N
T_gen`` FLOPs (Kaplan et al. 2020 sec. 2.1), so at matmul throughput ``G`` (:func:`matmul_gflops`: square fp32
``torch.mm``, ``2 n^3`` FLOPs each) the floor rate is ``batch * G / flops`` samples/s.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

Event = dict[str, Any]

__all__ = ["floor_samples_per_s", "markdown_table", "matmul_gflops", "step_flops", "summarize_arm"]


def _steps(events: list[Event]) -> list[Event]:
    return sorted((e for e in events if e["kind"] == "step"), key=lambda e: e["step"])


def _evals(events: list[Event]) -> list[Event]:
    return sorted((e for e in events if e["kind"] == "eval"), key=lambda e: e["step"])


def summarize_arm(
    events: list[Event], launch_t: float, batch: int, *, steady_skip: float = 0.1, eval_delta: float = 0.15
) -> dict[str, Any]:
    """The measures of one arm's run (see the module docstring for each definition).

    Args:
        events: the run's step and eval events (any order). launch_t: epoch s of the launch.
        batch: samples per optimizer step (> 0). steady_skip: fraction of the steps left out at the
            start, in [0, 1). eval_delta: the eval reward gain to time.

    Returns:
        ``{"steps", "wall_s" (launch to last step), "samples_per_s", "steady_from_step",
        "first_step_s", "eval_target", "eval_target_s", "eval_step0", "eval_final", "evals":
        [[step, reward, s since launch]], "mean_tokens_per_step", "mean_completion_tokens_per_step"}``.

    Raises:
        ValueError: no step events, fewer than two steps in the steady window, bad ``batch`` or
            ``steady_skip``.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    if not 0 <= steady_skip < 1:
        raise ValueError(f"steady_skip must be in [0, 1), got {steady_skip}")
    steps = _steps(events)
    if not steps:
        raise ValueError("no step events: the arm trained no step")
    last = steps[-1]
    s0 = max(1, math.ceil(steady_skip * last["step"]))
    start = next((e for e in steps if e["step"] >= s0), None)
    if start is None or start["step"] >= last["step"] or last["t"] <= start["t"]:
        raise ValueError(
            f"need at least two steps from step {s0} on to measure a rate, have steps up to {last['step']}"
        )
    rate = batch * (last["step"] - start["step"]) / (last["t"] - start["t"])
    evals = _evals(events)
    base = next((e["reward_mean"] for e in evals if e["step"] == 0), None)
    target = None if base is None else base + eval_delta
    hit = None if target is None else next((e for e in evals if e["step"] > 0 and e["reward_mean"] >= target), None)
    tokens = [e["num_tokens"] for e in steps if e.get("num_tokens") is not None]
    gen = [e["completion_tokens"] for e in steps if e.get("completion_tokens") is not None]
    return {
        "steps": last["step"],
        "wall_s": last["t"] - launch_t,
        "samples_per_s": rate,
        "steady_from_step": start["step"],
        "first_step_s": steps[0]["t"] - launch_t if steps[0]["step"] == 1 else None,
        "eval_step0": base,
        "eval_target": target,
        "eval_target_s": None if hit is None else hit["t"] - launch_t,
        "eval_final": evals[-1]["reward_mean"] if evals else None,
        "evals": [[e["step"], e["reward_mean"], e["t"] - launch_t] for e in evals],
        "mean_tokens_per_step": statistics.fmean(tokens) if tokens else None,
        "mean_completion_tokens_per_step": statistics.fmean(gen) if gen else None,
    }


def step_flops(num_params: int, train_tokens: float, gen_tokens: float) -> float:
    """FLOPs of one step: ``6 * N * T_train + 2 * N * T_gen`` (see the module docstring).

    Raises:
        ValueError: a negative or non-finite argument, or ``num_params == 0``.
    """
    for name, value in (("num_params", num_params), ("train_tokens", train_tokens), ("gen_tokens", gen_tokens)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if num_params == 0:
        raise ValueError("num_params must be positive")
    return 6.0 * num_params * train_tokens + 2.0 * num_params * gen_tokens


def floor_samples_per_s(batch: int, flops_per_step: float, gflops: float) -> float:
    """The machine floor's rate: ``batch / (flops_per_step / (gflops * 1e9))`` samples/s.

    Raises:
        ValueError: a non-positive argument.
    """
    if batch <= 0 or flops_per_step <= 0 or gflops <= 0:
        raise ValueError(f"batch, flops_per_step and gflops must be positive, got {batch}, {flops_per_step}, {gflops}")
    return batch * gflops * 1e9 / flops_per_step


def matmul_gflops(threads: int, sizes: tuple[int, ...] = (1024, 2048), repeats: int = 7) -> dict[str, Any]:
    """fp32 matmul throughput of this machine at ``threads`` torch threads.

    For each ``n`` in ``sizes``: two warm-up products, then ``repeats`` timed ``torch.mm`` of two
    ``[n, n]`` float32 matrices (``2 n^3`` FLOPs each); the size's value is the median GFLOP/s. The
    result is the best size's median (the throughput the floor assumes). Restores torch's thread
    count afterwards.

    Returns:
        ``{"gflops": float, "threads": int, "per_size": {n: median GFLOP/s}}``.

    Raises:
        ValueError: ``threads < 1``, an empty ``sizes`` or ``repeats < 1``.
    """
    import torch

    if threads < 1 or not sizes or repeats < 1:
        raise ValueError(f"need threads >= 1, sizes and repeats >= 1, got {threads}, {sizes}, {repeats}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_size = {}
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            for _ in range(2):
                torch.mm(a, b)
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.mm(a, b)
                rates.append(2.0 * n**3 / (time.perf_counter() - t0) / 1e9)
            per_size[n] = statistics.median(rates)
    finally:
        torch.set_num_threads(before)
    return {"gflops": max(per_size.values()), "threads": threads, "per_size": per_size}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def markdown_table(trl: dict[str, Any], rlbus: dict[str, Any], floor: dict[str, Any]) -> str:
    """The benchmark's markdown table: one row per measure, columns TRL, rlbus, rlbus/TRL.

    Args:
        trl, rlbus: aggregated arm summaries (keys of :func:`summarize_arm`).
        floor: ``{"gflops", "flops_per_step", "samples_per_s"}`` of the floor.
    """
    rows = [
        ("steady-state samples/s", trl["samples_per_s"], rlbus["samples_per_s"], 1, True),
        ("launch to first optimizer step (s)", trl["first_step_s"], rlbus["first_step_s"], 1, True),
        ("launch to eval +0.15 over step 0 (s)", trl["eval_target_s"], rlbus["eval_target_s"], 1, True),
        ("launch to last step (s)", trl["wall_s"], rlbus["wall_s"], 1, True),
        ("eval reward step 0", trl["eval_step0"], rlbus["eval_step0"], 3, False),
        ("final eval reward", trl["eval_final"], rlbus["eval_final"], 3, True),
    ]
    lines = ["| measure | TRL | rlbus | rlbus/TRL |", "|---|---|---|---|"]
    for name, a, b, digits, with_ratio in rows:
        lines.append(f"| {name} | {_fmt(a, digits)} | {_fmt(b, digits)} | {_ratio(b, a) if with_ratio else ''} |")
    lines.append(
        f"| machine floor samples/s ({_fmt(floor['gflops'])} GFLOP/s, {_fmt(floor['flops_per_step'] / 1e9, 2)} "
        f"GFLOP/step) "
        f"| | {_fmt(floor['samples_per_s'])} | rlbus/floor: {_ratio(rlbus['samples_per_s'], floor['samples_per_s'])} |"
    )
    return "\n".join(lines)
