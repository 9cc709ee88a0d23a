"""The FastAPI app of ``busctl serve``: API-key check and request metrics on every route, the session and
capability routes here, the training and future routes in :mod:`service.training_routes` (route table:
docs/service.md). A missing or wrong key gets 401 and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Histogram

from service.keys import key_ok, request_key
from service.state import ServiceState
from service.sampling_routes import add_sampling_routes
from service.training_routes import add_training_routes

REQUESTS = Counter(
    "rlbus_serve_requests_total", "HTTP requests of the API, by route and status code", ["route", "code"]
)
LATENCY = Histogram(
    "rlbus_serve_request_seconds",
    "Seconds to answer one HTTP request of the API (a long poll counts its wait), by route",
    ["route"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 20, 30, 60),
)


def build_app(state: ServiceState) -> FastAPI:
    """The app over ``state``; its lifespan ticks ``state.futures`` every 0.5 s."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.loop = asyncio.get_running_loop()

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.5)
                state.futures.tick()

        task = asyncio.create_task(tick())
        yield
        task.cancel()

    app = FastAPI(title="rlbus serve", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        route = request.url.path if request.url.path.startswith("/api/v1/") else "other"
        if route.startswith("/api/v1/training_runs/") or route.startswith("/api/v1/sessions/"):
            route = "/".join(route.split("/")[:4])
        started = time.perf_counter()
        if not key_ok(request_key(request.headers), state.keys):
            response: Response = JSONResponse({"detail": "invalid or missing API key"}, status_code=401)
        else:
            response = await call_next(request)
        REQUESTS.labels(route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(time.perf_counter() - started)
        return response

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {
            "supported_models": [
                {"model_name": m, "trainable": True, "sampleable": True, "max_context_length": None}
                for m in state.served_models
            ]
        }

    @app.post("/api/v1/create_session")
    async def create_session() -> dict:
        return {"type": "create_session", "session_id": state.new_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        body = await request.json()
        if body.get("session_id") not in state.sessions:
            return JSONResponse({"detail": "unknown session"}, status_code=410)
        return JSONResponse({"type": "session_heartbeat"})

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> Response:
        state.sessions.discard(session_id)
        return JSONResponse(None)

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    add_training_routes(app, state)
    add_sampling_routes(app, state)
    return app
