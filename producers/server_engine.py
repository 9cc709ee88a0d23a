"""ServerEngine: a producer's rollout engine on inference servers over HTTP, in place of `RolloutEngine`.

Same interface as `producers.engine.RolloutEngine` for what the producer, episodes, endpoint and the three weight
receivers use (`version`, `tokenizer`, `generate_group`, `load_weights_from_path`, `apply_rpc`; the broadcast
method's `init_weight_group`, `leave_weight_group`, `update_weights`), so the group logic runs unchanged on either.
Each group goes to the open server with the fewest samples in flight. Policy versions are exact per sample: an
update closes every server to new requests, waits for its requests in flight (drain: `producers.weight_update: keep`
acts as drain here), loads, tags the version and reopens it; a request is labelled with its server's version when
sent. A server that stops answering, or whose `/weight_info` no longer shows the version it was given (restarted),
is closed; its requests are re-issued on another server, and once it answers again (a managed one is restarted,
`producers.server_launch`) the last update is replayed on it before it samples again (a broadcast cannot be: it
waits for a re-formed group); a server added mid-run (`busctl scale servers=N`) joins the same way, a removed one
is drained first. The story: docs/ARCHITECTURE.md, "Producers on inference servers".
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from configs.model_path import resolve_model_path
from producers.rollout_sample import Sample
from producers.server_clients import DEFAULT_VERSION_TAG, ServerUnavailable, detect_kind, make_client
from producers.server_group import BROADCAST_RPC, WeightGroupMixin

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

MONITOR_INTERVAL_S = 0.5
"""How often each server's `/weight_info` is checked (a restart shows as a lost version tag), seconds."""


@dataclass
class _Slot:
    """One server: its client, launcher (managed) or None, the version it holds (None: not synced), samples in
    flight, and whether it takes new requests."""

    url: str
    client: Any = None
    launcher: Any = None
    version: int | None = None
    inflight: int = 0
    open: bool = False
    healing: asyncio.Task | None = None
    restarts: int = 0
    served: int = 0
    in_group: bool = False  # its worker joined the trainer's broadcast group (broadcast method)


class ServerEngine(WeightGroupMixin):
    """Rollouts on the servers at `urls` (or started by `launchers`, `producers.server_launch.ServerLauncher`).

    `kind`: "auto" (asked from each server), "vllm" or "sglang". `start_timeout_s`: most seconds a server takes to
    answer at start or after a restart; `request_timeout_s`: one request's limit. `new_launcher(k)`: the launcher of
    the k-th managed server (0-based), for `resize`. ValueError: no server.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        urls: list[str] = (),
        launchers: list[Any] = (),
        kind: str = "auto",
        initial_version: int = 0,
        update_mode: str = "drain",
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        new_launcher: Callable[[int], Any] | None = None,
    ) -> None:
        if not urls and not launchers:
            raise ValueError("ServerEngine needs server URLs or launchers")
        self.model_path = resolve_model_path(model_path)
        self._slots = [_Slot(url) for url in urls] + [_Slot(launcher.url, launcher=launcher) for launcher in launchers]
        self._kind, self._version, self.update_mode = kind, initial_version, update_mode
        self._new_launcher = new_launcher
        self._start_timeout_s, self._request_timeout_s = start_timeout_s, request_timeout_s
        self._last_update: tuple[str, dict, int] | None = None  # (worker method, kwargs, version): replayed
        self._group: dict | None = None  # init_weight_group's kwargs while in the trainer's broadcast group
        self._tokenizer = None
        self._http = None
        self._changed: asyncio.Condition | None = None
        self._update_lock: asyncio.Lock | None = None
        self._monitor: asyncio.Task | None = None
        self._broken: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> float:
        """Start the managed servers, wait until every server answers and holds `initial_version`; seconds."""
        import httpx
        from transformers import AutoTokenizer

        started = time.perf_counter()
        self._http = httpx.AsyncClient(  # idle connections dropped before uvicorn's 5 s keep-alive closes them
            timeout=httpx.Timeout(self._request_timeout_s, connect=5.0), limits=httpx.Limits(keepalive_expiry=2.0)
        )
        self._changed, self._update_lock = asyncio.Condition(), asyncio.Lock()
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        for slot in self._slots:
            if slot.launcher is not None:
                slot.launcher.start()
        try:
            await asyncio.gather(*(self._connect(slot) for slot in self._slots))
        except BaseException:
            await self.close()
            raise
        self._monitor = asyncio.create_task(self._watch())
        elapsed = time.perf_counter() - started
        log.info("%d inference server(s) ready in %.1f s: %s", len(self._slots), elapsed, self.urls)
        return elapsed

    async def close(self) -> None:
        """Stop watching, cancel healing, stop managed servers, close the HTTP client (idempotent)."""
        tasks = [t for t in [self._monitor, *(s.healing for s in self._slots)] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor = None
        for slot in self._slots:
            slot.healing, slot.open = None, False
            if slot.launcher is not None:
                await asyncio.to_thread(slot.launcher.stop)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> ServerEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs."""
        return [slot.url for slot in self._slots]

    @property
    def version(self) -> int:
        """Policy version of the last update applied (every open server holds it or a newer one)."""
        return self._version

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (loaded from `model_path` in this process)."""
        if self._tokenizer is None:
            raise RuntimeError("ServerEngine not started")
        return self._tokenizer

    def server_versions(self) -> dict[str, int | None]:
        """Each server's weight version (None: down or not yet re-synced)."""
        return {slot.url: slot.version if slot.open else None for slot in self._slots}

    def served(self) -> dict[str, int]:
        """Requests sent to each server so far (a URL listed twice counts once, summed)."""
        out: dict[str, int] = {}
        for slot in self._slots:
            out[slot.url] = out.get(slot.url, 0) + slot.served
        return out

    def restarts(self) -> int:
        """Servers lost and healed so far (restarted, or found without their version)."""
        return sum(slot.restarts for slot in self._slots)

    # -- servers added and removed mid-run (busctl scale servers=N) ----------------------------------

    async def add_server(self, url: str | None = None) -> str:
        """Add the server at `url` (None: a managed one, `new_launcher`), return its URL once it holds the current
        weights and takes requests. ValueError: no `url` and no `new_launcher`."""
        self._require()
        if self._group is not None:
            raise ValueError("a producer in the broadcast weight group drives one server (it is one rank)")
        if url is None:
            if self._new_launcher is None:
                raise ValueError("no url given and no new_launcher to start a server with")
            launcher = self._new_launcher(sum(s.launcher is not None for s in self._slots))
            slot = _Slot(launcher.url, launcher=launcher)
            launcher.start()
        else:
            slot = _Slot(url.rstrip("/"))
        self._slots.append(slot)
        slot.healing = asyncio.create_task(self._heal(slot))  # connect and replay the last update
        await asyncio.shield(slot.healing)
        if not slot.open:
            raise RuntimeError(f"{slot.url} was added but could not be brought to version {self._version}")
        log.info("server %s added (%d in all)", slot.url, len(self._slots))
        return slot.url

    async def remove_server(self, url: str | None = None) -> str:
        """Close the server at `url` (None: the last one), wait for its requests in flight, drop it and stop it if
        managed; its URL. ValueError: an unknown `url`, or the last server."""
        self._require()
        matches = [s for s in self._slots if url is None or s.url == url.rstrip("/")]
        if not matches:
            raise ValueError(f"no server {url!r} (servers: {self.urls})")
        if len(self._slots) == 1:
            raise ValueError("cannot remove the last server")
        slot = matches[-1]
        async with self._update_lock:  # no update starts on it meanwhile
            if slot.healing is not None:
                slot.healing.cancel()
                await asyncio.gather(slot.healing, return_exceptions=True)
            async with self._changed:
                slot.open = False
                await self._changed.wait_for(lambda: slot.inflight == 0)
                self._slots.remove(slot)
                self._changed.notify_all()
        if slot.launcher is not None:
            await asyncio.to_thread(slot.launcher.stop)
        log.info("server %s removed (%d left)", slot.url, len(self._slots))
        return slot.url

    async def resize(self, n: int) -> None:
        """Add managed servers or remove the last ones until `n` remain; returns when the added ones are in sync.
        ValueError: `n` < 1, or adding without `new_launcher`."""
        if n < 1:
            raise ValueError(f"need at least one server, got {n}")
        while len(self._slots) > n:
            await self.remove_server()
        if len(self._slots) < n:
            await asyncio.gather(*(self.add_server() for _ in range(n - len(self._slots))))

    # -- generation ------------------------------------------------------------------------------

    async def generate_group(
        self,
        prompt_token_ids: list[int],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        request_id: str,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] = (),
        detokenize: bool = True,
    ) -> list[Sample]:
        """`RolloutEngine.generate_group` on the least busy open server; re-issued (same seed) on a lost server.

        ValueError: `n` or `max_tokens` < 1, `min_tokens` out of range, an empty prompt; RuntimeError: the server
        refused the request (e.g. a prompt longer than its max_model_len)."""
        if n < 1 or max_tokens < 1 or not 0 <= min_tokens <= max_tokens:
            raise ValueError(
                f"need n >= 1, max_tokens >= 1 and 0 <= min_tokens <= max_tokens, "
                f"got n={n}, max_tokens={max_tokens}, min_tokens={min_tokens}"
            )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        params = dict(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        attempt = 0
        while True:
            slot = await self._take(n)
            version = slot.version
            try:
                out = await slot.client.generate(prompt_token_ids, request_id=f"{request_id}-a{attempt}", **params)
            except ServerUnavailable as exc:
                log.warning("%s lost during request %s (%s); re-issuing it", slot.url, request_id, exc)
                self._lose(slot)
                attempt += 1
                continue
            finally:
                await self._release(slot, n)
            return [Sample(c.token_ids, c.logprobs, c.text, c.finish_reason, version, version) for c in out]

    async def _take(self, n: int) -> _Slot:
        """The open server with the fewest samples in flight (waits for one), charged `n` samples."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._broken is not None or any(s.open for s in self._slots))
            self._require()
            slot = min((s for s in self._slots if s.open), key=lambda s: s.inflight)
            slot.inflight += n
            slot.served += 1
            return slot

    async def _release(self, slot: _Slot, n: int) -> None:
        async with self._changed:
            slot.inflight -= n
            self._changed.notify_all()

    async def score_completion(self, *args: Any, **kwargs: Any) -> list[float]:
        """Not served: a teacher runs in-process only (the config refuses one with servers)."""
        raise NotImplementedError("ServerEngine does not score completions (no teacher with producers.engine: server)")

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights_from_path(self, version: int, path: str | Path) -> float:
        """Every server loads the safetensors directory `path` (full or LoRA payload) as `version`; seconds.
        ValueError if `version` is the current one."""
        return await self.apply_rpc(version, "load_weights_from_path", {"path": str(path)})

    async def apply_rpc(
        self, version: int, rpc: str, kwargs: dict, *, resend: bool = False, reports: list | None = None
    ) -> float:
        """Drain, run worker method `rpc(**kwargs)`, tag, reopen, on every reachable server at once; seconds.
        `reports` (the bus method) gets each server's first `{"version": loaded, ...}`, lowest version first; each
        server is tagged with what it loaded. A server lost meanwhile gets this update when it is back."""
        self._require()
        async with self._update_lock:
            if (version == self._version and not resend) or (rpc == BROADCAST_RPC and version < self._version):
                raise ValueError(f"version {version} cannot replace current {self._version} by {rpc}")
            targets = [s for s in self._slots if s.healing is None and (rpc != BROADCAST_RPC or s.in_group)]
            if rpc == BROADCAST_RPC and not targets:
                raise RuntimeError(f"no server in the weight group to receive version {version}")
            started = time.perf_counter()
            self._last_update = (rpc, dict(kwargs), version)
            results = await asyncio.gather(
                *(self._apply_one(s, rpc, kwargs, None if reports is not None else version) for s in targets),
                return_exceptions=True,
            )
            loaded = []
            for slot, result in zip(targets, results):
                if isinstance(result, ServerUnavailable):
                    log.warning(
                        "%s lost during the update to version %d (%s); it re-syncs when back", slot.url, version, result
                    )
                    self._lose(slot)
                elif isinstance(result, BaseException):
                    self._broken = f"weight update to version {version} failed on {slot.url}: {result!r}"
                    async with self._changed:
                        self._changed.notify_all()
                    raise result
                else:
                    loaded.append(result)
            if reports is not None:  # none: every server lost; each replays this update when back
                reports.extend(sorted(loaded, key=lambda r: r["version"]))
                reports += [] if loaded else [{"version": version, "rejected": {}, "num_bytes": 0, "num_buckets": 0}]
                version = reports[0]["version"]
            self._version = version
            return time.perf_counter() - started

    async def _apply_one(self, slot: _Slot, rpc: str, kwargs: dict, version: int | None) -> Any:
        """Close `slot`, wait for its requests in flight, apply, reopen at the version loaded; its first result."""
        async with self._changed:
            slot.open = False
            await self._changed.wait_for(lambda: slot.inflight == 0)
        results = await slot.client.apply(rpc, kwargs, version)
        first = results[0] if results else None
        loaded = version if version is not None else int(first["version"])
        async with self._changed:
            slot.version, slot.open = loaded, True
            self._changed.notify_all()
        return first if version is None else loaded

    # -- servers lost and healed -----------------------------------------------------------------

    async def _connect(self, slot: _Slot) -> None:
        """Wait until `slot` answers, make its client, bring it to the current weights, open it."""
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                kind = self._kind if self._kind != "auto" else await detect_kind(self._http, slot.url)
                slot.client = make_client(kind, slot.url, self._http)
                if await slot.client.healthy():
                    break
            except ServerUnavailable:
                pass
            if slot.launcher is not None:
                slot.launcher.ensure_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{slot.url} did not answer within {self._start_timeout_s:.0f} s")
            await asyncio.sleep(0.5)
        await self._sync(slot)

    async def _sync(self, slot: _Slot) -> None:
        """Bring a reachable server to the current weights: replay the last update, or (none yet) reload the
        checkpoint if the server holds another run's weights; tag and open it."""
        async with self._update_lock:
            if self._last_update is not None and self._last_update[0] == BROADCAST_RPC:
                log.warning("%s is back outside the weight group: closed until a re-formed group's send", slot.url)
                return  # a broadcast cannot be replayed: the receiver asks the trainer to re-form the group
            if self._last_update is not None:
                rpc, kwargs, version = self._last_update
                results = await slot.client.apply(rpc, kwargs, version if rpc != "receive_weights_bus" else None)
                loaded = int(results[0]["version"]) if rpc == "receive_weights_bus" else version
            else:
                tag = await slot.client.weight_version()
                if tag not in (DEFAULT_VERSION_TAG, str(self._version)):
                    log.info("%s holds weights tagged %r: reloading %s", slot.url, tag, self.model_path)
                    await slot.client.apply("load_weights_from_path", {"path": self.model_path}, self._version)
                else:
                    await slot.client.set_version(self._version)
                loaded = self._version
            async with self._changed:
                slot.version, slot.open = loaded, True
                self._changed.notify_all()
        log.info("%s in sync at version %d", slot.url, loaded)

    def _lose(self, slot: _Slot) -> None:
        """Close `slot` and heal it in the background (once)."""
        slot.open, slot.version, slot.in_group = False, None, False
        if slot.healing is None and self._monitor is not None:
            slot.restarts += 1
            slot.healing = asyncio.create_task(self._heal(slot))

    async def _heal(self, slot: _Slot) -> None:
        try:
            while True:
                try:
                    await self._connect(slot)
                    return
                except (ServerUnavailable, TimeoutError) as exc:
                    log.warning("%s not back yet (%s); retrying", slot.url, exc)
                except RuntimeError as exc:  # e.g. a pruned version directory: the next update syncs it
                    log.error("re-syncing %s failed: %s; it waits for the next update", slot.url, exc)
                    return
        finally:
            slot.healing = None

    async def _watch(self) -> None:
        """Close every open server whose version tag is gone (restarted) or that does not answer."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            for slot in self._slots:
                if slot.launcher is not None and not slot.launcher.alive() and slot.healing is None:
                    log.warning("%s exited; restarting it", slot.url)
                    self._lose(slot)
                    continue
                if not slot.open or slot.healing is not None or self._update_lock.locked():
                    continue
                before = slot.version
                try:
                    tag = await slot.client.weight_version()
                except (ServerUnavailable, RuntimeError):
                    tag = None
                if slot.open and slot.version == before and tag != str(before) and not self._update_lock.locked():
                    log.warning("%s lost its version %s (it answers %r); re-syncing it", slot.url, slot.version, tag)
                    self._lose(slot)

    def _require(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"ServerEngine is broken ({self._broken}); close it")
        if self._http is None:
            raise RuntimeError("ServerEngine not started")
