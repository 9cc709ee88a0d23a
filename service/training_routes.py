"""The training routes of the Tinker API and ``retrieve_future``: each call is submitted to the trainer over
the bus and answered with its request id at once (``UntypedAPIFuture``); ``retrieve_future`` long-polls up to
``serve.long_poll_s`` (well inside the SDK's 45 s) and answers ``try_again``, the result (protobuf for
ForwardBackwardOutput when asked), ``{"error", "category"}``, or 410 for a request it does not know.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from service.futures import Request as ApiRequest
from service.sampling_routes import render_sample, sampler_session
from service.state import ServiceState, training_model_id
from service.tinker_wire import (
    ForwardBackwardCall,
    WireInputError,
    flatten,
    forward_backward_output_proto,
    parse_forward_backward_proto,
    split_outputs,
    tensor_json,
)

PROTO = "application/x-protobuf"


def _future(request_id: str, model_id: str | None = None) -> dict:
    return {"request_id": request_id, "model_id": model_id}


def _bad(why: str) -> JSONResponse:
    return JSONResponse({"detail": why}, status_code=400)


def parse_forward_backward_json(body: dict) -> ForwardBackwardCall:
    """The JSON form of a forward_backward request (xorl-client, older SDKs)."""
    fb = body.get("forward_backward_input") or body.get("forward_input") or body
    datums = []
    for i, d in enumerate(fb.get("data", [])):
        model_input = d.get("model_input", {})
        chunks = model_input.get("chunks", [{"tokens": model_input.get("input_ids", [])}])  # xorl: input_ids
        if any(c.get("type", "encoded_text") != "encoded_text" for c in chunks):
            raise WireInputError(f"datum {i}: only encoded_text model input is served")
        toks = np.asarray([t for c in chunks for t in c.get("tokens", [])], dtype=np.int64)
        inputs = {}
        for name, t in (d.get("loss_fn_inputs") or {}).items():
            data = t.get("data", t) if isinstance(t, dict) else t
            inputs[name] = np.asarray(data, dtype=np.float64).reshape(-1)
        datums.append((toks, inputs))
    return ForwardBackwardCall(
        model_id=body.get("model_id", ""),
        seq_id=body.get("seq_id"),
        loss_fn=fb.get("loss_fn", "cross_entropy"),
        loss_fn_config=dict(fb.get("loss_fn_config") or fb.get("loss_fn_params") or {}),
        forward_only=bool(body.get("forward_only", False)),
        batch=flatten(datums),
    )


def render(req: ApiRequest, accept: str) -> Response:
    """The finished request's result as the client expects it."""
    reply = req.reply
    assert reply is not None
    if not reply.ok:
        return JSONResponse({"error": reply.error, "category": reply.category})
    body: dict[str, Any] = dict(reply.body)
    if req.op == "forward_backward":
        lens = req.extra["datum_lens"]
        names = body.get("outputs", [])
        if PROTO in accept:
            data = forward_backward_output_proto(names, reply.outputs, lens, body.get("metrics", {}))
            return Response(data, media_type=PROTO)
        outs = [{k: tensor_json(v) for k, v in d.items()} for d in split_outputs(names, reply.outputs, lens)]
        return JSONResponse(
            {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outs, "metrics": body.get("metrics", {})}
        )
    if req.op == "optim_step":
        return JSONResponse({"metrics": body.get("metrics", {})})
    if req.op == "create_model":
        return JSONResponse({"model_id": body["model_id"], "type": "create_model"})
    if req.op == "save_weights" and req.extra.get("sampler"):
        return JSONResponse(
            {"path": body["path"], "sampling_session_id": req.extra.get("session"), "type": "save_weights_for_sampler"}
        )
    if req.op == "save_weights":
        return JSONResponse({"path": body["path"], "type": "save_weights"})
    if req.op == "sample":
        return render_sample(req, accept)
    if req.op == "load_weights":
        return JSONResponse({"path": body.get("path"), "model_id": body.get("model_id"), "type": "load_weights"})
    return JSONResponse({k: v for k, v in body.items() if k != "elapsed_s"})


def add_training_routes(app: FastAPI, state: ServiceState) -> None:
    """Register the training and future routes on ``app``."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> Response:
        b = await request.json()
        if "model_id" in b and "session_id" not in b:  # xorl-client: the client names its model
            model_id = str(b["model_id"])
        elif b.get("session_id") not in state.sessions:
            return _bad(f"unknown session {b.get('session_id')!r}")
        else:
            model_id = training_model_id(b["session_id"], int(b.get("model_seq_id", 0)))
        lora = b.get("lora_config")
        state.futures.sequencer.start(model_id)
        state.last_model = model_id
        rid = state.call("create_model", model_id, {"base_model": b.get("base_model", ""), "lora": lora})
        return JSONResponse(_future(rid, model_id))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> Response:
        b = await request.json()
        rid = state.call("get_info", b.get("model_id", ""), {})
        req = await state.futures.wait(rid, 300)
        if req is None or req.reply is None:
            return JSONResponse({"detail": "the trainer did not answer get_info"}, status_code=503)
        if not req.reply.ok:
            return JSONResponse({"detail": req.reply.error}, status_code=404)
        info = req.reply.body
        return JSONResponse(
            {
                "type": "get_info",
                "model_id": info["model_id"],
                "model_name": info["base_model"],
                "is_lora": info["is_lora"],
                "lora_rank": info["lora_rank"],
                "model_data": {
                    "arch": info["arch"],
                    "model_name": info["base_model"],
                    "tokenizer_id": info["tokenizer_id"],
                },
            }
        )

    @app.post("/api/v1/forward_backward")
    @app.post("/api/v1/forward")
    async def forward_backward(request: Request) -> Response:
        raw = await request.body()
        try:
            if PROTO in request.headers.get("content-type", ""):
                fb = parse_forward_backward_proto(raw, request.headers.get("content-encoding", ""))
            else:
                import json

                fb = parse_forward_backward_json(json.loads(raw))
        except (WireInputError, ValueError) as err:
            return _bad(str(err))
        if request.url.path.endswith("/forward"):
            fb.forward_only = True
        body = {
            "loss_fn": fb.loss_fn,
            "loss_fn_config": fb.loss_fn_config,
            "forward_only": fb.forward_only,
            "loss_inputs": fb.batch.names,
        }
        batch = fb.batch
        rid = state.futures.submit(
            _call("forward_backward", fb.model_id, body, batch.token_ids, batch.datum_lens, batch.loss_inputs),
            fb.seq_id,
            datum_lens=batch.datum_lens,
        )
        return JSONResponse(_future(rid, fb.model_id))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> Response:
        b = await request.json()
        params = b.get("adam_params") or b.get("optim_params") or {}
        rid = state.call("optim_step", b["model_id"], {"adam_params": params}, b.get("seq_id"))
        return JSONResponse(_future(rid, b["model_id"]))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> Response:
        b = await request.json()
        rid = state.call("save_weights", b["model_id"], {"name": b.get("path"), "kind": "state"}, b.get("seq_id"))
        return JSONResponse(_future(rid, b["model_id"]))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Response:
        b = await request.json()
        name, session = b.get("path"), None
        if not name:  # save_weights_and_get_sampling_client: a sampling session on the saved weights
            name = f"sampler-{uuid.uuid4().hex[:8]}"
            session = f"{b['model_id'].split(':')[0]}:sample:{b.get('sampling_session_seq_id', 0)}"
            path = f"tinker://{b['model_id']}/sampler_weights/{name}"
            state.sampling_sessions[session] = sampler_session(state, None, path)
        msg = _call("save_weights", b["model_id"], {"name": name, "kind": "sampler"})
        rid = state.futures.submit(msg, b.get("seq_id"), sampler=True, session=session)
        return JSONResponse(_future(rid, b["model_id"]))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> Response:
        b = await request.json()
        model_id = b.get("model_id")
        if model_id is None:  # create_training_client_from_state: a new client of this session
            model_id = training_model_id(b.get("session_id", ""), int(b.get("model_seq_id", 0)))
            state.futures.sequencer.start(model_id)
        body = {"path": b.get("path", ""), "optimizer": bool(b.get("optimizer", False))}
        rid = state.call("load_weights", model_id, body, b.get("seq_id") or None)
        return JSONResponse(_future(rid, model_id))

    @app.post("/sync_inference_weights")
    async def sync_inference_weights(request: Request) -> Response:
        """xorl-client's weight sync: the model's weights saved for the samplers (no NCCL group: the samplers
        load them from the run directory); the sampling session ``MODEL:synced`` samples them."""
        b = await request.json()
        model_id = b.get("model_id") or state.last_model
        started = time.monotonic()
        name = f"sync-{uuid.uuid4().hex[:8]}"
        path = f"tinker://{model_id}/sampler_weights/{name}"
        rid = state.futures.submit(_call("save_weights", model_id, {"name": name, "kind": "sampler"}), None)
        req = await state.futures.wait(rid, 600)
        if req is None or req.reply is None or not req.reply.ok:
            why = req.reply.error if req is not None and req.reply is not None else "the trainer did not answer"
            return JSONResponse({"success": False, "message": why})
        state.sampling_sessions[f"{model_id}:synced"] = sampler_session(state, None, path)
        size = sum(f.stat().st_size for f in Path(req.reply.body["weights_dir"]).glob("*.safetensors"))
        return JSONResponse(
            {
                "success": True,
                "message": f"saved {path} for the samplers (sampling session {model_id}:synced)",
                "transfer_time": time.monotonic() - started,
                "total_bytes": size,
                "num_buckets": 1,
            }
        )

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request) -> Response:
        b = await request.json()
        rid = state.call("unload_model", b["model_id"], {})
        return JSONResponse(_future(rid, b["model_id"]))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        b = await request.json()
        rid = b.get("request_id", "")
        req = await state.futures.wait(rid, state.cfg.serve.long_poll_s)
        if req is None:
            return JSONResponse({"detail": f"request {rid} is unknown or expired"}, status_code=410)
        if req.reply is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        return render(req, request.headers.get("accept", ""))

    @app.post("/api/v1/cancel_future")
    async def cancel_future() -> Response:
        return JSONResponse(None)


def _call(op: str, model_id: str, body: dict, token_ids=None, datum_lens=None, loss_inputs=None):
    from bus.messages import new_id
    from bus.messages_api import ApiCall

    arrays = {}
    if token_ids is not None:
        arrays = {"token_ids": token_ids, "datum_lens": datum_lens, "loss_inputs": loss_inputs}
    return ApiCall(id=new_id(), op=op, model_id=model_id, body=body, **arrays)
