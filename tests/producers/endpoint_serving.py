"""A started OpenAI-compatible endpoint on a real vLLM engine for the endpoint tests
(tests/producers/test_endpoint.py, test_verifiers_envs.py): the engine and the aiohttp server run
on an event loop in a daemon thread; everything is stopped and the engine's processes are checked
gone on exit."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from producers.endpoint import OpenAIEndpoint
from producers.engine import RolloutEngine
from tests.producers.test_weight_sync import assert_no_leftover_processes


@contextlib.contextmanager
def served_endpoint(model_dir: Path, max_model_len: int) -> Iterator[tuple[OpenAIEndpoint, Callable[[Any], Any]]]:
    """``(started endpoint, run)`` for the model at ``model_dir`` (processed logprobs, 32 MiB KV
    cache); ``run(coro)`` runs a coroutine on the endpoint's loop and returns its result (300 s)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    eng = RolloutEngine(
        model_dir,
        max_model_len=max_model_len,
        kv_cache_bytes=32 * 1024**2,
        engine_kwargs={"logprobs_mode": "processed_logprobs"},
    )
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(300)
    endpoint = None
    try:
        run(eng.start())
        endpoint = OpenAIEndpoint(eng, eng.tokenizer, max_model_len=max_model_len)
        run(endpoint.start())
        yield endpoint, run
    finally:
        if endpoint is not None:
            run(endpoint.close())
        run(eng.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        assert_no_leftover_processes()
