"""How many processes a producer's vLLM engine starts: on CPU, the Worker runs inside the EngineCore.

`vllm.v1.engine.async_llm.AsyncLLM` always runs its EngineCore in a spawned process. On CPU, vLLM's
platform hook (`vllm.platforms.cpu.CpuPlatform.check_and_update_config`) also swaps the
single-process executor for the multiprocess one whenever `VLLM_ENABLE_V1_MULTIPROCESSING` is "1"
(its default), so the EngineCore spawns a Worker process in turn: three interpreters that each
import vLLM (~6 s apiece on the 2-core CPU host, one after the other, on the start-up critical path;
bench/README.md "Start-up"). With the variable "0" while the engine is built, the CPU platform
keeps the single-process executor: the Worker (and with it the weight-sync worker extension,
`broadcaster.worker_extension`) lives in the EngineCore process, one vLLM import less, and no
shared-memory queue between EngineCore and Worker is left to busy-poll (`producers.vllm_idle`).
`AsyncLLM` itself ignores the variable (it has no in-process core client).

The multiprocess executor also gives its Worker `OMP_NUM_THREADS` = the usable CPUs less one
(kept for the EngineCore's scheduling); the single-process executor sets nothing, and an EngineCore
with OpenMP's default thread count ran a 16 x 8 x 16-token batch 10-15x slower on the 2-core host
(3.3-4.8 s against 0.2-0.3 s). :func:`engine_core_env` therefore sets the same thread count for the
spawned EngineCore unless the caller's environment already has one.

An eager engine (`enforce_eager`, the producers' setting) still `torch.compile`s one helper of its
sampler with inductor (`vllm.v1.sample.ops.logprobs.batched_count_greater_than`, the rank of each
sampled token's logprob): its first call, the engine's warm-up request, spent ~1.8 s hashing
torch's sources and compiling (py-spy). `TORCH_COMPILE_DISABLE=1` in the EngineCore runs it eagerly:
the warm-up then takes ~0.03 s, and a 16 x 8 x 16-token batch took the same time (medians of 10
batches, 0.20-0.26 s either way, alternating).

Invariants: only the spawned EngineCore inherits the changed variables, and the calling process's
environment is restored on exit (that process imported `torch._dynamo.config`, which reads
TORCH_COMPILE_DISABLE once, with vLLM, before: it keeps its own setting). On a GPU nothing changes (there vLLM's single-GPU executor is
already in-process; tensor parallelism needs its worker processes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MULTIPROCESSING_ENV", "engine_core_env", "engine_core_threads"]

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch; "0" while the engine is built keeps the CPU Worker inside the EngineCore."""


def engine_core_threads() -> int:
    """OpenMP threads for an EngineCore that runs its Worker: the CPUs this process may use less
    one (vLLM's multiprocess executor reserves one for scheduling), at least 1."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@contextmanager
def engine_core_env(*, on_gpu: bool, eager: bool = True) -> Iterator[None]:
    """Environment in which to construct `AsyncLLM` (it spawns the EngineCore inside).

    Args:
        on_gpu: the engine runs on CUDA (`producers.engine.vllm_on_gpu`): nothing is changed.
        eager: the engine runs with `enforce_eager` (no compiled model).

    On CPU, sets `VLLM_ENABLE_V1_MULTIPROCESSING=0`, and each of these the caller has not set:
    `OMP_NUM_THREADS` to :func:`engine_core_threads`, with `eager` `TORCH_COMPILE_DISABLE=1`
    (module docstring); all are restored (or removed) on exit.
    """
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
