"""The ``serve`` section: ``busctl serve``'s HTTP front door (the Tinker API and xorl-client's routes,
docs/service.md): where it listens, who may call it, which base models it serves."""

from __future__ import annotations

from pydantic import Field

from configs.base import Section


class ServeConfig(Section):
    """``busctl serve``: the API process (``service/``) and the trainer it drives over the bus."""

    host: str = Field("127.0.0.1", description="Address the HTTP API binds (0.0.0.0: every interface).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the API (0: any free port, logged).")
    api_keys_file: str = Field(
        "",
        description="A file of API keys, one per line (keys start with 'tml-', the Tinker SDK's rule). "
        "RLBUS_SERVE_API_KEYS (comma-separated) adds keys; with none at all the API refuses to start.",
    )
    models: list[str] = Field(
        default_factory=list, description="Base models served besides model.path (local directories or HF ids)."
    )
    full_finetune: bool = Field(
        True, description="Allow training clients without LoRA (every weight trained, own copy of the model)."
    )
    long_poll_s: float = Field(
        20.0, gt=0, le=40, description="How long retrieve_future waits for a result before answering try_again."
    )
    samplers: int = Field(
        1, ge=0, le=8, description="Sampler processes (one vLLM engine each, producers/api_proc.py); 0: no sampling."
    )
    only: bool = Field(False, description="Set by busctl serve: the run is the service (hub, trainer, serve).")
