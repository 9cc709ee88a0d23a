"""The producers' engine choice: vLLM in the producer's process, or inference servers driven over HTTP.

:class:`EngineFields` is the part of ``producers`` (:class:`configs.schema.ProducersConfig` inherits it) that says
where generation runs; :func:`check_server_engine` is the run-wide rule it needs (the weight methods a server takes).
How servers are attached, started and kept in sync: docs/operations.md, "Inference servers". Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from configs.base import Section

SERVER_WEIGHT_METHODS = ("filesystem", "bus")
"""The `broadcast.method` values a producer on servers takes (the torch.distributed group is in-process only)."""


class EngineFields(Section):
    """Where a producer generates: its own vLLM engine or inference servers over HTTP."""

    engine: Literal["vllm", "server"] = Field(
        "vllm",
        description="vllm: each producer runs vLLM in its process. server: each producer drives inference servers "
        "over HTTP (token ids in and out), those of producers.servers or, if that is empty, vLLM servers it starts "
        "itself; rlbus's own environment then needs no vLLM when producers.servers is given (docs/operations.md).",
    )
    servers: list[str] = Field(
        default_factory=list,
        description="engine server: URLs (http://host:port) of running servers, shared by every producer (each "
        "spreads its groups over them by outstanding requests). vLLM servers need VLLM_SERVER_DEV_MODE=1, "
        "--worker-extension-cls broadcaster.worker_extension.WeightSyncExtension and --logprobs-mode "
        "processed_logprobs. Empty: each producer starts servers_per_replica vLLM servers.",
    )
    server_kind: Literal["auto", "vllm", "sglang"] = Field(
        "auto", description="Kind of the servers; auto: asked from each (/version: vLLM, /get_server_info: SGLang)."
    )
    servers_per_replica: int = Field(
        1, ge=1, le=64, description="engine server without producers.servers: vLLM servers each producer starts."
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments of the vLLM servers a producer starts (e.g. [--max-num-seqs, '64']).",
    )
    server_start_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds a server may take to answer /health at start or after a restart."
    )
    server_request_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds one generation or weight-update request to a server may take."
    )

    @field_validator("servers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ValueError(f"producers.servers entry {url!r} is not a URL like http://host:port")
        return [url.rstrip("/") for url in urls]


def check_server_engine(cfg: Any) -> None:
    """For a `RunConfig` with ``producers.engine: server``: an unset ``broadcast.method`` becomes ``bus`` (no
    shared filesystem needed); ValueError for ``broadcast`` (a server's workers cannot join the trainer's
    torch.distributed group) or a teacher (scored in-process)."""
    if cfg.producers.engine != "server":
        return
    if "method" not in cfg.broadcast.model_fields_set:
        cfg.broadcast.method = "bus"
    if cfg.broadcast.method not in SERVER_WEIGHT_METHODS:
        raise ValueError(
            f"producers.engine: server takes weights by broadcast.method {' or '.join(SERVER_WEIGHT_METHODS)}, "
            f"not {cfg.broadcast.method!r}"
        )
    if cfg.teacher.model_path:
        raise ValueError("producers.engine: server does not run a teacher; unset teacher.model_path")
