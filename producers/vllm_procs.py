"""How many processes a producer's vLLM engine starts: on CPU, the Worker runs inside the EngineCore.

`AsyncLLM` always spawns its EngineCore; on CPU, `VLLM_ENABLE_V1_MULTIPROCESSING=0` while it is built keeps vLLM's
single-process executor, so the Worker (and `broadcaster.worker_extension`) lives in the EngineCore: one vLLM import
(~6 s on the 2-core host) less and no shared-memory queue to busy-poll. The EngineCore then gets `OMP_NUM_THREADS` =
usable CPUs - 1, as the multiprocess executor gave its Worker (OpenMP's default ran batches 10-15x slower), and an
eager engine `TORCH_COMPILE_DISABLE=1` (vLLM's inductor-compiled sampler helper cost ~1.8 s at warm-up, nothing
after). Only the spawned EngineCore sees these; the caller's environment is restored. On a GPU nothing changes.
See docs/ARCHITECTURE.md, "vLLM on a CPU host".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MULTIPROCESSING_ENV", "engine_core_env", "engine_core_threads"]

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch; "0" while the engine is built keeps the CPU Worker inside the EngineCore."""


def engine_core_threads() -> int:
    """OpenMP threads for an EngineCore that runs its Worker: usable CPUs less one (for scheduling), >= 1."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@contextmanager
def engine_core_env(*, on_gpu: bool, eager: bool = True) -> Iterator[None]:
    """Environment in which to construct `AsyncLLM`: unchanged ``on_gpu``; on CPU the variables above (the
    thread count and, if ``eager``, `TORCH_COMPILE_DISABLE` only where the caller set none), restored on exit."""
    if on_gpu:
        yield
        return
    changes = {MULTIPROCESSING_ENV: "0"}
    if not os.environ.get("OMP_NUM_THREADS"):
        changes["OMP_NUM_THREADS"] = str(engine_core_threads())
    if eager and not os.environ.get("TORCH_COMPILE_DISABLE"):
        changes["TORCH_COMPILE_DISABLE"] = "1"
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
