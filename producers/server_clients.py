"""HTTP clients of one inference server each, token ids in and out: vLLM's OpenAI server and SGLang's.

A client generates one prompt's group with per-token sampled logprobs and, for weights, pauses, calls a worker
method and tags the server's weight version (vLLM: `/pause`, `/collective_rpc` into
`broadcaster.worker_extension.WeightSyncExtension`, `/update_weight_version`, `/resume`, under
`VLLM_SERVER_DEV_MODE=1`). A server that does not answer raises :class:`ServerUnavailable` (the engine re-issues the
request elsewhere and re-syncs the server when it is back); any other refusal raises RuntimeError. SGLang's client
(`/generate` with `input_ids`, `/update_weights_from_disk`) is written to its documented API and has never run
against a server here (docs/operations.md, "Inference servers").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Completion", "SGLangClient", "ServerUnavailable", "VLLMClient", "detect_kind", "make_client"]

UNAVAILABLE = (httpx.TransportError, httpx.TimeoutException)
"""httpx errors that mean the server is not there (down, restarting, unreachable)."""

DEFAULT_VERSION_TAG = "default"
"""vLLM's `/weight_info` answer before any `/update_weight_version`: a fresh (or restarted) server."""


class ServerUnavailable(ConnectionError):
    """The server did not answer (connection refused or reset, 502/503, a timeout)."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: `token_ids` and their sampled `logprobs` (`[num_tokens]`), `finish_reason`."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


async def _call(http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> Any:
    """The JSON answer (None if empty); ServerUnavailable or RuntimeError (with the server's message)."""
    for attempt in (0, 1):  # once more: a kept-alive connection the server closed meanwhile fails at once
        try:
            response = await http.request(method, url, **kwargs)
            break
        except UNAVAILABLE as exc:
            if attempt or isinstance(exc, httpx.TimeoutException):
                raise ServerUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
            await asyncio.sleep(0.2)
    if response.status_code in (502, 503, 504):
        raise ServerUnavailable(f"{method} {url}: HTTP {response.status_code}")
    if response.status_code >= 400:
        raise RuntimeError(f"{method} {url}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else None


async def detect_kind(http: httpx.AsyncClient, url: str) -> str:
    """ "sglang" if `/get_server_info` answers, else "vllm" if `/version` does; ServerUnavailable or RuntimeError."""
    for kind, path in (("sglang", "/get_server_info"), ("vllm", "/version")):
        try:
            await _call(http, "GET", url + path)
            return kind
        except RuntimeError:
            continue
    raise RuntimeError(f"{url} answers neither /get_server_info (SGLang) nor /version (vLLM)")


class VLLMClient:
    """One vLLM OpenAI-compatible server (`vllm serve`, dev mode for weights)."""

    kind = "vllm"

    def __init__(self, url: str, http: httpx.AsyncClient, model: str | None = None) -> None:
        self.url, self.http, self.model = url, http, model

    async def healthy(self) -> bool:
        """Whether `/health` answers 200 now."""
        try:
            await _call(self.http, "GET", self.url + "/health")
            return True
        except (ServerUnavailable, RuntimeError):
            return False

    async def served_model(self) -> str:
        """The first model `/v1/models` lists (completions name it)."""
        models = await _call(self.http, "GET", self.url + "/v1/models")
        return models["data"][0]["id"]

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        request_id: str,
        min_tokens: int = 0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] = (),
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """`n` completions of `prompt_ids` by `/v1/completions` (token-id prompt, `logprobs: 0`, tokens as ids), in
        sample-index order; the server's seeding (`seed + j` for sample j) and logprobs mode."""
        if self.model is None:
            self.model = await self.served_model()
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "repetition_penalty": repetition_penalty,
            "seed": seed,
            "stop": list(stop),
            "ignore_eos": ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "request_id": request_id,
        }
        out = await _call(self.http, "POST", self.url + "/v1/completions", json=body)
        completions = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            lp = choice["logprobs"]
            ids = choice.get("token_ids")
            if ids is None:  # servers without return_token_ids: "token_id:123" strings
                ids = [int(t.rpartition(":")[2]) for t in lp["tokens"]]
            logprobs = [float(x) for x in lp["token_logprobs"]]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"{self.url}: {len(ids)} tokens but {len(logprobs)} logprobs")
            completions.append(Completion(list(ids), logprobs, choice.get("text") or "", str(choice["finish_reason"])))
        if len(completions) != n:
            raise RuntimeError(f"{self.url}: asked for {n} completions, got {len(completions)}")
        return completions

    async def weight_version(self) -> str:
        """The version tag the server's weights carry (`DEFAULT_VERSION_TAG` on a fresh server)."""
        return str((await _call(self.http, "GET", self.url + "/weight_info"))["weight_version"])

    async def apply(self, method: str, kwargs: dict, version: int | None) -> list:
        """Pause (requests in flight finish, the prefix cache is cleared), run worker `method(**kwargs)` in every
        worker, tag `version` (None: the first worker's `{"version"}` result), resume; the workers' results."""
        await _call(self.http, "POST", self.url + "/pause", params={"mode": "wait", "clear_cache": "true"})
        try:
            results = await self.call(method, kwargs)
            tag = version if version is not None else results[0]["version"]
            await self.set_version(int(tag))
        finally:
            await _call(self.http, "POST", self.url + "/resume")
        return results

    async def call(self, method: str, kwargs: dict) -> list:
        """Run worker `method(**kwargs)` in every worker by `/collective_rpc`, without pausing; their results."""
        out = await _call(self.http, "POST", self.url + "/collective_rpc", json={"method": method, "kwargs": kwargs})
        return (out or {}).get("results", [])

    async def set_version(self, version: int) -> None:
        """Tag the server's weights as `version` (what `/weight_info` then answers)."""
        await _call(self.http, "POST", self.url + "/update_weight_version", json={"new_version": str(version)})


class SGLangClient:
    """One SGLang server (`python -m sglang.launch_server`). UNTESTED: SGLang did not install on these hosts."""

    kind = "sglang"

    def __init__(self, url: str, http: httpx.AsyncClient, model: str | None = None) -> None:
        self.url, self.http, self.model = url, http, model
        self._version = DEFAULT_VERSION_TAG

    async def healthy(self) -> bool:
        try:
            await _call(self.http, "GET", self.url + "/health")
            return True
        except (ServerUnavailable, RuntimeError):
            return False

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        request_id: str,
        min_tokens: int = 0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] = (),
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """`n` completions by `/generate` (a batch of n copies of `input_ids`, `return_logprob`; sample j seeded
        `seed + j` through `sampling_seed`)."""
        params = [
            {
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": max_tokens,
                "min_new_tokens": min_tokens,
                "repetition_penalty": repetition_penalty,
                "stop": list(stop),
                "ignore_eos": ignore_eos,
                **({} if seed is None else {"sampling_seed": seed + j}),
            }
            for j in range(n)
        ]
        body = {"input_ids": [list(prompt_ids)] * n, "sampling_params": params, "return_logprob": True}
        out = await _call(self.http, "POST", self.url + "/generate", json=body)
        completions = []
        for item in out:
            pairs = item["meta_info"]["output_token_logprobs"]  # [[logprob, token_id, text], ...]
            finish = item["meta_info"].get("finish_reason") or {}
            completions.append(
                Completion(
                    [int(p[1]) for p in pairs],
                    [float(p[0]) for p in pairs],
                    item.get("text", ""),
                    str(finish.get("type", "stop")) if isinstance(finish, dict) else str(finish),
                )
            )
        return completions

    async def weight_version(self) -> str:
        out = await _call(self.http, "GET", self.url + "/get_weight_version")
        return str((out or {}).get("weight_version", self._version))

    async def apply(self, method: str, kwargs: dict, version: int | None) -> list:
        """`load_weights_from_path` only: `/update_weights_from_disk` (an HF model directory; no LoRA payload)."""
        if method != "load_weights_from_path":
            raise RuntimeError(f"SGLang servers take weights by the filesystem method only, not {method!r}")
        body = {"model_path": kwargs["path"], "weight_version": str(version), "flush_cache": True}
        out = await _call(self.http, "POST", self.url + "/update_weights_from_disk", json=body)
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"{self.url}: update_weights_from_disk failed: {out.get('message')}")
        await self.set_version(int(version))
        return [out]

    async def call(self, method: str, kwargs: dict) -> list:
        """Refused: rlbus's worker extension is vLLM's (SGLang's own /init_weights_update_group is not driven)."""
        raise RuntimeError(f"SGLang servers take weights by the filesystem method only, not {method!r}")

    async def set_version(self, version: int) -> None:
        self._version = str(version)
        await _call(self.http, "POST", self.url + "/update_weight_version", json={"new_version": str(version)})


def make_client(kind: str, url: str, http: httpx.AsyncClient) -> VLLMClient | SGLangClient:
    """The client of a server of `kind` ("vllm" or "sglang"); ValueError for another."""
    if kind == "vllm":
        return VLLMClient(url, http)
    if kind == "sglang":
        return SGLangClient(url, http)
    raise ValueError(f"server kind must be 'vllm' or 'sglang', got {kind!r}")
