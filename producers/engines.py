"""The one place that turns `producers.engine` into a producer's rollout engine.

`vllm`: `producers.engine.RolloutEngine` in the producer's process. `server`: `producers.server_engine.ServerEngine`
on producer i's share of `producers.servers` (`servers[i::replicas]`: no server has two producers, whose updates and
pauses would cross), or on `servers_per_replica` vLLM servers the producer starts (`producers.server_launch`),
logged to `RUN_DIR/logs/<producer>-server-<k>.log`. Only the in-process engine imports vLLM.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producers.vllm_idle import BUSY_LOOP_ENV
from producers.vllm_procs import MULTIPROCESSING_ENV, engine_core_threads

if TYPE_CHECKING:
    from configs.schema import RunConfig

__all__ = ["attached_servers", "build_engine", "managed_server_env"]


def managed_server_env(on_gpu: bool) -> dict[str, str]:
    """Environment of a managed vLLM server: dev mode (weights), rlbus importable (its worker extension), and on
    CPU the in-process engine's settings (`producers.vllm_procs`, `producers.vllm_idle`)."""
    root = str(Path(__file__).resolve().parents[1])
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": os.pathsep.join([root, *[p for p in path if p != root]])}
    if not on_gpu:
        env |= {MULTIPROCESSING_ENV: "0", BUSY_LOOP_ENV: "0.005"}
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or str(engine_core_threads()))
        env.setdefault("TORCH_COMPILE_DISABLE", os.environ.get("TORCH_COMPILE_DISABLE") or "1")
    return env


def attached_servers(cfg: "RunConfig", index: int) -> list[str]:
    """Producer `index`'s share of `producers.servers`: every `replicas`-th from `index`. ValueError: `index` beyond
    `producers.replicas` (a producer added by `busctl scale` would share another's servers)."""
    p = cfg.producers
    if not 0 <= index < p.replicas:
        raise ValueError(f"producer {index}: producers.servers are split among producers.replicas={p.replicas}")
    return list(p.servers[index :: p.replicas])


def build_engine(cfg: "RunConfig", index: int, name: str) -> Any:
    """Producer `index`'s (named `name`) engine, not started."""
    p = cfg.producers
    kv_cache_bytes = int(p.kv_cache_gib * 2**30)
    if p.engine == "vllm":
        from producers.engine import RolloutEngine

        return RolloutEngine(
            cfg.model.path,
            max_model_len=cfg.model.max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            seed=p.seed + index,
            tensor_parallel_size=p.tensor_parallel_size,
            gpu_memory_utilization=p.gpu_memory_utilization,
            dtype=p.dtype,
            update_mode=p.weight_update,
            # post-temperature logprobs: the trainer scores with the same temperature
            engine_kwargs={"logprobs_mode": "processed_logprobs"},
            fork_engine_core=True,  # a producer has run no OpenMP work before its engine starts
        )
    from producers.server_engine import ServerEngine

    new_launcher = None if p.servers else functools.partial(_launcher, cfg, index, name, kv_cache_bytes)
    launchers = [new_launcher(k) for k in range(p.servers_per_replica)] if new_launcher else []
    return ServerEngine(
        cfg.model.path,
        urls=attached_servers(cfg, index) if p.servers else [],
        launchers=launchers,
        kind=p.server_kind if p.servers else "vllm",
        update_mode="drain",
        start_timeout_s=p.server_start_timeout_s,
        request_timeout_s=p.server_request_timeout_s,
        new_launcher=new_launcher,  # busctl scale servers=N
    )


def _launcher(cfg: "RunConfig", index: int, name: str, kv_cache_bytes: int, k: int) -> Any:
    """The launcher of producer `index`'s k-th managed server (a fresh port each call)."""
    from broadcaster.dtypes import resolve_producer_dtype
    from configs.model_path import resolve_model_path
    from producers.server_launch import ServerLauncher, server_command

    p = cfg.producers
    on_gpu = bool(p.gpus_per_replica) and os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1")
    dtype = resolve_producer_dtype(p.dtype, cuda_available=on_gpu)
    port = ServerLauncher.pick_port()
    command = server_command(
        resolve_model_path(cfg.model.path),
        port,
        max_model_len=cfg.model.max_model_len,
        dtype=dtype,
        seed=p.seed + index,
        kv_cache_bytes=kv_cache_bytes,
        on_gpu=on_gpu,
        tensor_parallel_size=p.tensor_parallel_size,
        gpu_memory_utilization=p.gpu_memory_utilization if on_gpu else None,
        extra_args=list(p.server_args),
    )
    log_path = Path(cfg.run_dir) / "logs" / f"{name}-server-{k}.log"
    return ServerLauncher(command, port, env=managed_server_env(on_gpu), log_path=log_path)
