"""How many processes a producer's vLLM engine starts: on CPU, the Worker runs inside the EngineCore.

`AsyncLLM` always runs its EngineCore in a child; on CPU, `VLLM_ENABLE_V1_MULTIPROCESSING=0` while it is built
keeps vLLM's single-process executor, so the Worker (and `broadcaster.worker_extension`) lives in the EngineCore:
one vLLM import (~6 s on the 2-core host) less and no shared-memory queue to busy-poll. The EngineCore then gets
`OMP_NUM_THREADS` = usable CPUs - 1, as the multiprocess executor gave its Worker (OpenMP's default ran batches
10-15x slower), and an eager engine `TORCH_COMPILE_DISABLE=1` (vLLM's inductor-compiled sampler helper cost ~1.8 s
at warm-up, nothing after). Only the EngineCore sees these; the caller's environment is restored.
`build_async_llm(fork=True)` forks the EngineCore from the caller once vLLM is imported there (a spawned one imports
torch and vLLM again, ~7 s of CPU on the 2-core host, 14 s of wall), for a process whose OpenMP pool never started (a
producer at start, or one that called `pin_torch_to_one_thread` first: a test process), and `kill_engine_cores` ends
it at close without vLLM's slow teardown. On a GPU nothing changes. See docs/ARCHITECTURE.md, "vLLM on a CPU host".
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lifecycle.parent_death import die_with_parent

__all__ = [
    "MULTIPROCESSING_ENV",
    "build_async_llm",
    "engine_core_env",
    "engine_core_threads",
    "forks_safely",
    "kill_engine_cores",
    "pin_torch_to_one_thread",
]

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


_pinned = False  # pin_torch_to_one_thread was called


def pin_torch_to_one_thread() -> None:
    """Run this process's torch on one thread, so that an EngineCore forked from it is safe at any later time. Call
    it before any torch work: a child forked after a GNU OpenMP pool started hangs in its first parallel region (a
    pinned process never starts the pool; the fork sets its own thread count). For a process that runs torch work
    and then builds engines: a test process."""
    global _pinned
    import torch

    torch.set_num_threads(1)
    _pinned = True


def forks_safely() -> bool:
    """Whether `pin_torch_to_one_thread` was called in this process (an engine's default for forking)."""
    return _pinned


_forking = False  # True while build_async_llm forks: read by the child's at-fork hook
_forking_parent = 0  # the pid that forks


def _forked_engine_core() -> None:
    """(In a child forked while `_forking`.) Die with the producer (SIGKILL); OpenMP read its thread count, and
    dynamo `TORCH_COMPILE_DISABLE`, when the parent imported torch: set both from the EngineCore's environment."""
    if _forking:
        import torch

        die_with_parent(signal.SIGKILL)  # a SIGKILLed producer's fork would live on (vLLM does not watch it)
        if os.getppid() != _forking_parent:
            os._exit(1)  # the producer died before the line above
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or engine_core_threads()))
        dynamo_config = sys.modules.get("torch._dynamo.config")
        if dynamo_config is not None and os.environ.get("TORCH_COMPILE_DISABLE") == "1":
            dynamo_config.disable = True


os.register_at_fork(after_in_child=_forked_engine_core)


def build_async_llm(engine_args: Any, *, on_gpu: bool, fork: bool = False) -> Any:
    """`AsyncLLM.from_engine_args(engine_args)`, inside `engine_core_env`; with ``fork`` on CPU the EngineCore is a
    fork of this process (vLLM's CPU platform sets "spawn" while it builds the config; "fork" is put back after)."""
    global _forking, _forking_parent
    from vllm.v1.engine.async_llm import AsyncLLM

    with engine_core_env(on_gpu=on_gpu, eager=bool(engine_args.enforce_eager)):
        if on_gpu or not fork:
            return AsyncLLM.from_engine_args(engine_args)
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor import Executor

        vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        saved, os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"), "fork"
        _forking, _forking_parent = True, os.getpid()
        try:
            return AsyncLLM(
                vllm_config=vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_requests=engine_args.enable_log_requests,
                log_stats=not engine_args.disable_log_stats,
            )
        finally:
            _forking = False
            if saved is None:
                os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
            else:
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = saved


def kill_engine_cores(llm: Any) -> int:
    """SIGKILL the local EngineCore processes of ``llm`` (an `AsyncLLM`) and reap them; returns how many. For a
    forked EngineCore before `llm.shutdown()`: it holds nothing durable, and its own teardown (vLLM's
    ``cleanup_dist_env_and_memory``: a ``gc.collect`` over the heap it shares with the producer) took 2-3 s."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    procs = [p for p in getattr(manager, "processes", []) if p.is_alive()]
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(timeout=10)
    return len(procs)
