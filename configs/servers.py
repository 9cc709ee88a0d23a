"""The producers' engine choice: vLLM in the producer's process, or inference servers driven over HTTP.

:class:`EngineFields` is the part of ``producers`` (:class:`configs.schema.ProducersConfig` inherits it) that says
where generation runs; :func:`check_server_engine` holds the run-wide rules it needs (the weight methods a server
takes, one server per producer for the broadcast method, attached servers split among the producers).
How servers are attached, started and kept in sync: docs/operations.md, "Inference servers". Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from configs.base import Section

SERVER_WEIGHT_METHODS = ("filesystem", "bus", "broadcast")
"""The `broadcast.method` values a producer on vLLM servers takes (SGLang servers: filesystem only)."""


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
        description="engine server: URLs (http://host:port) of running servers, split among the producers "
        "(producer i of producers.replicas drives servers[i::replicas] and spreads its groups over them by "
        "outstanding requests; a server's weights and pauses are its producer's alone). vLLM servers need "
        "VLLM_SERVER_DEV_MODE=1, "
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
    shared filesystem needed). ValueError: fewer ``producers.servers`` than ``producers.replicas`` (each server is
    one producer's), ``broadcast`` with more than one server per producer (a producer is one rank of the trainer's
    group), a method other than ``filesystem`` with ``server_kind: sglang``, or a teacher (scored in-process)."""
    p = cfg.producers
    if p.engine != "server":
        return
    if "method" not in cfg.broadcast.model_fields_set:
        cfg.broadcast.method = "bus"
    method = cfg.broadcast.method
    if method not in SERVER_WEIGHT_METHODS:
        raise ValueError(f"producers.engine: server takes broadcast.method {SERVER_WEIGHT_METHODS}, not {method!r}")
    if p.servers and len(p.servers) < p.replicas:
        raise ValueError(
            f"producers.servers lists {len(p.servers)} server(s) for {p.replicas} producers: each producer drives "
            "its own (servers[i::replicas]); list at least one per producer or lower producers.replicas"
        )
    per_producer_not_one = len(p.servers) != p.replicas if p.servers else p.servers_per_replica != 1
    if method == "broadcast" and per_producer_not_one:
        raise ValueError(
            "broadcast.method: broadcast takes one server per producer (its worker is the producer's rank in the "
            "trainer's group): producers.servers_per_replica: 1, or as many producers.servers as producers.replicas"
        )
    if p.server_kind == "sglang" and method != "filesystem":
        raise ValueError(f"SGLang servers take weights by broadcast.method: filesystem only, not {method!r}")
    if cfg.teacher.model_path:
        raise ValueError("producers.engine: server does not run a teacher; unset teacher.model_path")
