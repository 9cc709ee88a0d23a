"""Memory of packing one optimizer step of large groups: ``python -m bench.packer_memory``.

The scale sweep's 16 MiB point (bench/README.md, "Scale simulation") put the packer at ~1.4 GiB
peak RSS (~1.1 GiB since :mod:`packer.assemble`). Credit windows bound only what waits in its
``scored`` inbox (``bus.max_inflight_bytes``); this measures the rest, in-process and without the
bus: the Python-heap bytes (``tracemalloc``) of a step's groups, the peak while
:meth:`packer.packer.Packer.pop_step` packs them (the new micro-batches, filled straight from the
groups' arrays by :mod:`packer.assemble`), the micro-batches kept afterwards (what the ``batches``
outbox holds until the trainer releases the step), and the wall time of packing the step without
``tracemalloc`` (best of 3). Groups are built as the size sweep builds them
(:func:`bench.scale.size_spec`: equal completion lengths, G grown past 8 to keep a completion <= 64k
tokens).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from bench.scale import parse_size, size_spec
from bus.messages import ScoredGroup
from packer.packer import Packer


def make_group(index: int, group_size: int, tokens: int, prompt_tokens: int) -> ScoredGroup:
    """A scored group of ``group_size`` completions of ``tokens`` tokens each (zeros, version 0)."""
    lens = np.full(group_size, tokens, np.int32)
    n = int(lens.sum())
    versions = np.zeros(group_size, np.int64)
    return ScoredGroup(
        id=f"g{index}",
        prompt_index=index,
        step=0,
        task="sim",
        info={},
        producer="p",
        completion_texts=[""] * group_size,
        finish_reasons=["stop"] * group_size,
        gen_time_s=0.0,
        prompt_ids=np.arange(prompt_tokens, dtype=np.int32),
        completion_ids=np.zeros(n, np.int32),
        completion_lens=lens,
        sampler_logprobs=np.zeros(n, np.float32),
        version_start=versions,
        version_end=versions,
        temperature=1.0,
        reward_worker="r",
        rewards=np.zeros(group_size, np.float32),
        advantages=np.linspace(-1, 1, group_size).astype(np.float32),
    )


def measure(group_bytes: int, groups_per_step: int) -> dict[str, float]:
    """MiB of: the step's groups, the packing peak above them, the micro-batches kept; and
    ``pack_ms``, milliseconds to pack the step untraced (best of 3)."""
    spec = size_spec(group_bytes)
    tracemalloc.start()
    try:
        groups = [
            make_group(i, spec.group_size, spec.median_tokens, spec.prompt_tokens) for i in range(groups_per_step)
        ]
        held = tracemalloc.get_traced_memory()[0]
        packer = Packer(groups_per_step, 1, max(spec.median_tokens + spec.prompt_tokens, 4096))
        for group in groups:
            packer.add(group)
        tracemalloc.reset_peak()
        micro_batches, _ = packer.pop_step()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    count = len(micro_batches)
    del micro_batches  # the timed packs below each build the step anew
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        packer.pack(groups, 0)
        seconds.append(time.perf_counter() - start)
    mib = 1 << 20
    return {
        "group_size": spec.group_size,
        "tokens_per_sample": spec.median_tokens,
        "micro_batches": count,
        "groups_mib": held / mib,
        "packing_peak_above_groups_mib": (peak - held) / mib,
        "micro_batches_kept_mib": (kept - held) / mib,
        "pack_ms": min(seconds) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring). Returns the exit code."""
    parser = argparse.ArgumentParser(description="memory of packing one step of large groups")
    parser.add_argument("--group-bytes", default="16MiB", help="RolloutGroup size, as in bench.scale --sizes")
    parser.add_argument("--groups", type=int, default=8, help="groups per step (the 4x4 size point: 8)")
    args = parser.parse_args(argv)
    r = measure(parse_size(args.group_bytes), args.groups)
    print(
        f"{args.groups} groups of {args.group_bytes} (G={r['group_size']}, "
        f"{r['tokens_per_sample']} tokens per sample): groups {r['groups_mib']:.0f} MiB; "
        f"packing peak {r['packing_peak_above_groups_mib']:.0f} MiB above them; {r['micro_batches']} micro-batches "
        f"kept: {r['micro_batches_kept_mib']:.0f} MiB; packing took {r['pack_ms']:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
