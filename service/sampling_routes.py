"""The sampling routes of the Tinker API: sampling sessions (the base model or a ``save_weights_for_sampler``
checkpoint) and ``asample``, which goes to a sampler process (``producers/api_proc.py``) on the ``samplers``
topic; its result is a ``SampleResponse`` (protobuf when the client asks for it, as the SDK does: tokens,
per-token logprobs, stop reason, prompt logprobs with NaN for the first token).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runfiles.api_checkpoints import checkpoint_dir
from service.futures import Request as ApiRequest
from service.state import ServiceState

PROTO = "application/x-protobuf"


def sampler_session(state: ServiceState, base_model: str | None, model_path: str | None) -> dict:
    """The record of a sampling session; ValueError for a model or path this server does not serve."""
    if model_path:
        if "/sampler_weights/" not in model_path:
            raise ValueError(f"sample from a save_weights_for_sampler path, not {model_path!r}")
        weights = checkpoint_dir(Path(state.cfg.run_dir), model_path)
        return {
            "base_model": base_model or state.served_models[0],
            "model_path": model_path,
            "weights_dir": str(weights),
        }
    if base_model not in state.served_models:
        raise ValueError(f"base model {base_model!r} is not served here; served: {state.served_models}")
    return {"base_model": base_model, "model_path": None, "weights_dir": ""}


def render_sample(req: ApiRequest, accept: str) -> Response:
    """A finished sample call as ``SampleResponse`` (protobuf or JSON)."""
    body = req.reply.body  # type: ignore[union-attr]
    prompt_lp = body.get("prompt_logprobs")
    if PROTO in accept:
        from tinker.proto import tinker_public_pb2 as pb

        msg = pb.SampleResponse()
        for s in body["sequences"]:
            seq = msg.sequences.add()
            seq.stop_reason = pb.STOP_REASON_LENGTH if s["stop_reason"] == "length" else pb.STOP_REASON_STOP
            seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
            seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
        if prompt_lp is not None:
            msg.prompt_logprobs = np.array([np.nan if v is None else v for v in prompt_lp], np.float32).tobytes()
        return Response(msg.SerializeToString(), media_type=PROTO)
    return JSONResponse(
        {
            "type": "sample",
            "sequences": [
                {"stop_reason": s["stop_reason"], "tokens": s["tokens"], "logprobs": s["logprobs"]}
                for s in body["sequences"]
            ],
            "prompt_logprobs": prompt_lp,
        }
    )


def add_sampling_routes(app: FastAPI, state: ServiceState) -> None:
    """Register the sampling routes on ``app``."""

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        b = await request.json()
        try:
            record = sampler_session(state, b.get("base_model"), b.get("model_path"))
        except ValueError as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        sid = f"{b.get('session_id', '')}:sample:{b.get('sampling_session_seq_id', 0)}"
        state.sampling_sessions[sid] = record
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> Response:
        record = state.sampling_sessions.get(sampler_id)
        if record is None:
            return JSONResponse({"detail": f"no sampler {sampler_id}"}, status_code=404)
        return JSONResponse(
            {"sampler_id": sampler_id, "base_model": record["base_model"], "model_path": record["model_path"]}
        )

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> Response:
        b = await request.json()
        if not state.cfg.serve.samplers:
            return JSONResponse({"detail": "this server runs no sampler (serve.samplers: 0)"}, status_code=400)
        record = state.sampling_sessions.get(b.get("sampling_session_id") or "")
        try:
            if record is None:
                record = sampler_session(state, b.get("base_model"), b.get("model_path"))
            chunks = (b.get("prompt") or {}).get("chunks", [])
            if any(c.get("type", "encoded_text") != "encoded_text" for c in chunks):
                raise ValueError("only encoded_text prompts are served")
            tokens = np.asarray([t for c in chunks for t in c.get("tokens", [])], dtype=np.int64)
        except ValueError as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        body = {
            "num_samples": int(b.get("num_samples", 1)),
            "sampling_params": b.get("sampling_params") or {},
            "prompt_logprobs": bool(b.get("prompt_logprobs")),
            "weights_dir": record["weights_dir"],
        }
        rid = state.call(
            "sample",
            b.get("sampling_session_id") or "base",
            body,
            None,
            token_ids=tokens,
            datum_lens=np.array([len(tokens)], dtype=np.int64),
        )
        ids = [f"{rid}:{j}" for j in range(body["num_samples"])]
        return JSONResponse({"request_id": rid, "model_id": None, "sample_sequence_ids": ids})
