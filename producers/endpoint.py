"""An OpenAI-compatible HTTP endpoint on a producer's own vLLM engine (aiohttp on the producer's event loop):
``POST /v1/chat/completions``, ``POST /v1/completions`` (non-streaming), ``GET /v1/models``. Responses of an open
episode are recorded (:mod:`producers.endpoint_episodes`), so agents written against the ``openai`` client produce
token-exact rollouts.

Fields taken: :data:`FIELDS` (``prompt`` may be token ids; ``logprobs`` gives the sampled token's only; ``tools``
go to the chat template and Qwen/Hermes ``<tool_call>`` blocks come back as ``tool_calls``); ``user``,
``metadata``, ``store``, ``tool_choice``, ``parallel_tool_calls`` are ignored; others are HTTP 400. A request
naming an open episode (header ``X-Rlbus-Episode``, else ``user``) samples with the run's settings, not the
client's, and needs ``n=1``; an unknown episode is 404; a prompt over ``max_model_len`` is 400. Bound beyond
loopback, every request needs an API key (:mod:`configs.api_keys`: those of ``RLBUS_SERVE_API_KEYS`` and
``keys_file``, plus :attr:`OpenAIEndpoint.api_key`, made here for the producer's own agents); a missing or wrong
one gets 401 and nothing else.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any

from prometheus_client import Counter, Gauge

from configs.api_keys import is_loopback, key_ok, read_keys, request_key
from producers.endpoint_episodes import EPISODE_HEADER, EndpointEpisodes, RecordedTurn, chat_prompt_ids, reply_message

log = logging.getLogger(__name__)

ROUTES = ("chat", "completions")
REQUESTS = Counter(
    "rlbus_producer_endpoint_requests_total",
    "Requests to the producer's OpenAI-compatible endpoint, by route (chat, completions) and "
    "status (ok, bad_request, unknown_episode, error, unauthorized: no or a wrong API key)",
    ["route", "status"],
)
for _route in ROUTES:
    for _status in ("ok", "bad_request", "unknown_episode", "error", "unauthorized"):
        REQUESTS.labels(_route, _status)

PORT = Gauge(
    "rlbus_producer_endpoint_port",
    "TCP port of the producer's OpenAI-compatible endpoint (0: not serving); "
    "busctl records it per component in status.json",
)

_COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "user",
    "stream",
    "top_logprobs",
    "metadata",
    "store",
}
FIELDS = {
    "chat": _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls"},
    "completions": _COMMON | {"prompt"},
}
DEFAULT_MAX_TOKENS = 256
PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
UNAUTHORIZED = {
    "error": {"message": "invalid or missing API key", "type": "invalid_request_error", "code": "invalid_api_key"}
}


class BadRequest(ValueError):
    """A request the endpoint answers with HTTP ``status`` (400 malformed, 404 unknown episode)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _text(content: Any) -> str:
    """A message content as a string (OpenAI text parts joined)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("message content must be a string or a list of text parts")


def _messages(body: dict) -> list[dict]:
    """The request's messages as ``{"role", "content"[, "tool_calls", ...]}`` dicts with string contents."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadRequest("'messages' must be a non-empty list of objects with a 'role'")
    return [{**m, "content": _text(m.get("content"))} for m in messages]


def sampling_of(body: dict, route: str, sampling: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    """``(n, generate_group kwargs)``; an episode's ``sampling`` wins (the client's max_tokens may only lower it).

    Raises BadRequest: unknown fields, ``stream`` true, bad numbers, or n != 1 in an episode.
    """
    unknown = sorted(set(body) - FIELDS[route])
    if unknown:
        raise BadRequest(f"unsupported fields: {', '.join(unknown)}")
    if body.get("stream"):
        raise BadRequest("stream: true is not supported (non-streaming responses only)")
    try:
        n = int(body.get("n") or 1)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        temperature = float(1.0 if body.get("temperature") is None else body["temperature"])
        top_p = float(1.0 if body.get("top_p") is None else body["top_p"])
        seed = None if body.get("seed") is None else int(body["seed"])
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad number in the request: {exc}") from None
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings")
    if n < 1 or max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise BadRequest(
            f"need n >= 1, max_tokens >= 1, temperature >= 0, 0 < top_p <= 1; got n={n}, "
            f"max_tokens={max_tokens}, temperature={temperature}, top_p={top_p}"
        )
    kwargs = dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, stop=stop)
    if sampling is not None:
        if n != 1:
            raise BadRequest(f"an episode's requests must have n=1, got n={n}")
        kwargs = {**sampling, "stop": stop, "max_tokens": min(max_tokens, sampling.get("max_tokens", max_tokens))}
    return n, kwargs


class OpenAIEndpoint:
    """The HTTP server of one producer on its started engine; ``port`` 0: any free one (see :attr:`url`).
    ``keys_file``: the API keys accepted beyond loopback besides ``RLBUS_SERVE_API_KEYS``'s and :attr:`api_key`.
    ValueError: an unreadable ``keys_file``."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "rlbus-policy",
        keys_file: str = "",
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = any free), got {port}")
        self.engine, self.tokenizer, self.max_model_len = engine, tokenizer, max_model_len
        self.host, self.port, self.model_name = host, port, model_name
        self.episodes = EndpointEpisodes()  # open one before the agent runs, close it after
        self.url: str | None = None  # http://host:port/v1 once started: openai.OpenAI's base_url
        self.api_key = "rlbus"  # the key this producer's agents present (unchecked on loopback)
        self.keys: frozenset[str] | None = None  # accepted keys; None: loopback, no check
        if not is_loopback(host):
            self.api_key = f"rlbus-run-{secrets.token_urlsafe(24)}"
            outside = read_keys(keys_file, what="producers.endpoint_api_keys_file")
            if not outside:
                log.warning("endpoint on %s: no RLBUS_SERVE_API_KEYS or keys file; only this producer's agents", host)
            self.keys = outside | {self.api_key}
        self._runner = None
        self._ids = itertools.count()

    async def start(self) -> str:
        """Bind and serve on the running event loop; returns :attr:`url`."""
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            if self.keys is not None and not key_ok(request_key(request.headers), self.keys):
                if request.path in PATHS:
                    REQUESTS.labels(PATHS[request.path], "unauthorized").inc()
                return web.json_response(UNAUTHORIZED, status=401)
            return await handler(request)

        app = web.Application(client_max_size=64 * 2**20, middlewares=[guard])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        PORT.set(port)
        log.info("OpenAI-compatible endpoint at %s", self.url)
        return self.url

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            PORT.set(0)
            await runner.cleanup()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rlbus"}]}
        )

    async def _chat(self, request: Any) -> Any:
        return await self._handle(request, "chat")

    async def _completions(self, request: Any) -> Any:
        return await self._handle(request, "completions")

    async def _handle(self, request: Any, route: str) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            out = await self.complete(body, route, request.headers.get(EPISODE_HEADER) or body.get("user"))
        except BadRequest as exc:
            status = "unknown_episode" if exc.status == 404 else "bad_request"
            REQUESTS.labels(route, status).inc()
            return web.json_response(
                {"error": {"message": str(exc), "type": "invalid_request_error"}}, status=exc.status
            )
        except ValueError as exc:  # the body is not JSON
            REQUESTS.labels(route, "bad_request").inc()
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
        except Exception as exc:
            REQUESTS.labels(route, "error").inc()
            log.exception("endpoint request failed")
            return web.json_response(
                {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}}, status=500
            )
        REQUESTS.labels(route, "ok").inc()
        return web.json_response(out)

    async def complete(self, body: dict, route: str, episode_id: str | None = None) -> dict:
        """The response JSON to one request on ``route`` ("chat" or "completions"), recorded in an open episode.

        Raises BadRequest: a malformed request (400) or an unknown episode (404).
        """
        sampling = None
        if episode_id:
            sampling = self.episodes.sampling(episode_id)
            if sampling is None:
                raise BadRequest(f"episode {episode_id!r} is not open on this producer", 404)
        n, kwargs = sampling_of(body, route, sampling)
        messages = None
        if route == "chat":
            messages = _messages(body)
            last = self.episodes.last_turn(episode_id) if episode_id else None
            prompt_ids = chat_prompt_ids(self.tokenizer, messages, last, tools=body.get("tools"))
        else:
            prompt = body.get("prompt")
            if (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                prompt_ids = list(prompt)
            elif isinstance(prompt, str) and prompt:
                prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            else:
                raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt)")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        kwargs["max_tokens"] = min(kwargs["max_tokens"], room)
        version = self.engine.version
        request_id = f"oai-{next(self._ids)}"
        samples = await self.engine.generate_group(prompt_ids, n=n, request_id=request_id, **kwargs)
        texts = [s.text for s in samples]
        replies = [
            reply_message(text, body.get("tools"), f"call_{request_id}_{i}") if route == "chat" else None
            for i, text in enumerate(texts)
        ]
        if episode_id:
            self.episodes.record(
                episode_id, RecordedTurn(prompt_ids, samples[0], version, messages, texts[0], replies[0])
            )
        return self._response(route, request_id, samples, texts, replies, len(prompt_ids), bool(body.get("logprobs")))

    def _response(
        self,
        route: str,
        request_id: str,
        samples: list,
        texts: list[str],
        replies: list[dict | None],
        num_prompt: int,
        logprobs: bool,
    ) -> dict:
        choices = []
        for i, (s, text, reply) in enumerate(zip(samples, texts, replies)):
            finish = "length" if s.finish_reason == "length" else "stop"
            tokens = [self.tokenizer.decode([t]) for t in s.token_ids] if logprobs else []
            if route == "chat":
                lp = (
                    {
                        "content": [
                            {"token": tok, "logprob": v, "bytes": list(tok.encode()), "top_logprobs": []}
                            for tok, v in zip(tokens, s.logprobs)
                        ]
                    }
                    if logprobs
                    else None
                )
                choices.append(
                    {
                        "index": i,
                        "message": reply,
                        "logprobs": lp,
                        "finish_reason": "tool_calls" if reply.get("tool_calls") else finish,
                    }
                )
            else:
                lp = (
                    {"tokens": tokens, "token_logprobs": list(s.logprobs), "top_logprobs": None, "text_offset": []}
                    if logprobs
                    else None
                )
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        completion = sum(len(s.token_ids) for s in samples)
        return {
            "id": request_id,
            "object": "chat.completion" if route == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": num_prompt,
                "completion_tokens": completion,
                "total_tokens": num_prompt + completion,
            },
        }
