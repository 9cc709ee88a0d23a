"""RolloutEngine: the only place in a producer process that touches vLLM.

It wraps one `AsyncLLM` (EngineCore spawned or forked, `producers.vllm_procs`; workers carry
`broadcaster.worker_extension.WeightSyncExtension`): generate a group for one prompt (token ids in), apply new
weights, report the policy `version`. vLLM tags each output token with the weight version in effect
(`weight_versions` spans, expanded per token into `Sample.token_versions`). An update pauses the scheduler with
`clear_cache=True`, mode "keep" (in-flight requests are recomputed and continue under the new weights: partial
rollouts) or "drain" (vLLM's "wait": they finish under the old ones); updates are serialized, and a failed one marks
the engine broken (no token of half-loaded weights is ever tagged). Logprobs are "raw_logprobs" unless
`engine_kwargs` says "processed_logprobs" (the trainer must compute the same). Where the engine runs and its KV
cache: `device_engine_args`. The version-span story: docs/ARCHITECTURE.md, "Pace, staleness and accounting".
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from configs.model_path import resolve_model_path
from producers.rollout_sample import Sample, token_versions
from producers.vllm_idle import BUSY_LOOP_ENV
from producers.vllm_procs import build_async_llm, forks_safely, kill_engine_cores

logger = logging.getLogger(__name__)

#: `update_mode` -> vLLM's pause mode for a weight update.
UPDATE_MODES = {"keep": "keep", "drain": "wait"}

#: The worker extension class, importable in vLLM's spawned children (repo root on PYTHONPATH).
WORKER_EXTENSION_CLS = "broadcaster.worker_extension.WeightSyncExtension"


class RolloutEngine:
    """Async wrapper of vLLM's AsyncLLM for GRPO rollouts with in-place weight updates.

    `model_path`: HF directory or a hub id in the local cache (FileNotFoundError if neither). `kv_cache_bytes`: KV
    cache size in bytes. `warmup`: one short request in `start()` (the eager first batch costs ~3 s on CPU).
    `fork_engine_core`: on CPU fork the EngineCore (`producers.vllm_procs.build_async_llm`; only in a process that
    has run no OpenMP work; None: if this process called `producers.vllm_procs.pin_torch_to_one_thread`).
    `dtype`: `producers.dtype` ("auto" resolved by `broadcaster.dtypes`). `busy_loop_s`: cap on vLLM's queue
    readers' busy-poll (`producers.vllm_idle`; None: vLLM's 1 s). `engine_kwargs` override `AsyncEngineArgs`.
    ValueError: `max_model_len < 2`, a negative `busy_loop_s`, an unknown `update_mode`.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int = 1024,
        seed: int = 0,
        kv_cache_bytes: int = 512 * 1024**2,
        initial_version: int = 0,
        max_num_seqs: int = 256,
        warmup: bool = True,
        dtype: str = "float32",
        busy_loop_s: float | None = 0.005,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        update_mode: str = "keep",
        fork_engine_core: bool | None = None,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.update_mode = update_mode
        if busy_loop_s is not None and not busy_loop_s >= 0:
            raise ValueError(f"busy_loop_s must be >= 0 seconds or None, got {busy_loop_s!r}")
        self._busy_loop_s, self._on_gpu = busy_loop_s, vllm_on_gpu()
        self.model_path = resolve_model_path(model_path)
        self._engine_kwargs = dict(
            model=self.model_path,
            dtype=_resolved_dtype(dtype),
            max_model_len=max_model_len,
            enforce_eager=True,
            worker_extension_cls=WORKER_EXTENSION_CLS,
            logprobs_mode="raw_logprobs",
            seed=seed,
            max_num_seqs=max_num_seqs,
            disable_log_stats=True,
            **device_engine_args(
                on_gpu=self._on_gpu,
                kv_cache_bytes=kv_cache_bytes,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
        )
        self._engine_kwargs.update(engine_kwargs or {})
        self._version = initial_version
        self._warmup = warmup
        self._fork_engine_core = forks_safely() if fork_engine_core is None else fork_engine_core
        self._llm = None
        self._update_lock = None
        self._broken: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> float:
        """Start the engine process(es) (blocks the event loop ~10-15 s on CPU); returns seconds."""
        import asyncio

        from vllm.engine.arg_utils import AsyncEngineArgs

        if self._llm is not None:
            raise RuntimeError("RolloutEngine already started")
        start = time.perf_counter()
        _ensure_repo_on_pythonpath()
        if self._busy_loop_s is not None:  # read by producers.vllm_idle in every vLLM process
            os.environ[BUSY_LOOP_ENV] = repr(float(self._busy_loop_s))
        self._update_lock = asyncio.Lock()
        args = AsyncEngineArgs(**self._engine_kwargs)
        self._llm = build_async_llm(args, on_gpu=self._on_gpu, fork=self._fork_engine_core)
        try:
            await self._llm.update_weight_version(str(self._version))
            if self._warmup:
                await self.generate_group(
                    [0], n=1, temperature=1.0, top_p=1.0, max_tokens=2, request_id="rlbus-warmup", detokenize=False
                )
        except BaseException:
            await self.close()
            raise
        elapsed = time.perf_counter() - start
        logger.info("vLLM engine up in %.1f s", elapsed)
        return elapsed

    async def close(self) -> None:
        """Shut the engine down and wait for its processes to exit (idempotent)."""
        llm, self._llm = self._llm, None
        if llm is not None:
            if self._fork_engine_core and not self._on_gpu:
                kill_engine_cores(llm)  # a fork of this process: nothing to tear down but seconds of gc
            llm.shutdown()

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def update_mode(self) -> str:
        """ "keep" or "drain": how the next weight updates treat requests in flight."""
        return self._update_mode

    @update_mode.setter
    def update_mode(self, mode: str) -> None:
        if mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {sorted(UPDATE_MODES)}, got {mode!r}")
        self._update_mode = mode

    @property
    def version(self) -> int:
        """Policy version of the weights currently in the engine."""
        return self._version

    @property
    def tokenizer(self):
        """vLLM's Hugging Face tokenizer of the model (for decoding and EOS ids)."""
        return self._require().get_tokenizer()

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
        """Sample `n` completions of one prompt (FINAL_ONLY output), in sample-index order.

        `request_id`: unique among requests in flight. `repetition_penalty`: vLLM's (CTRL, arXiv:1909.05858; 1 =
        off). `seed`: sample `j` uses `seed + j` (None: the engine's stream). `detokenize=False` leaves `text` ""
        (always on with `stop`). ValueError: `n` or `max_tokens` < 1, `min_tokens` out of range, an empty prompt.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if n < 1 or max_tokens < 1 or not 0 <= min_tokens <= max_tokens:
            raise ValueError(
                f"need n >= 1, max_tokens >= 1 and 0 <= min_tokens <= max_tokens, "
                f"got n={n}, max_tokens={max_tokens}, min_tokens={min_tokens}"
            )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        llm = self._require()
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop=list(stop) or None,
            logprobs=0,  # the sampled token's logprob only
            detokenize=detokenize or bool(stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        version_issued = self._version
        final = None
        async for output in llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, request_id):
            final = output
        if final is None or not final.finished:
            raise RuntimeError(f"request {request_id} ended without a final output")
        version_done = self._version
        samples = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            logprobs = [completion.logprobs[i][tok].logprob for i, tok in enumerate(token_ids)]
            spans = tuple((int(span.version), span.start, span.end) for span in completion.weight_versions or ())
            per_token = token_versions(spans, len(token_ids), version_issued)
            # min/max, not first/last: after a rollback (a resumed trainer) later spans can be older
            versions = per_token.tolist() or [v for v, _, _ in spans] or [version_issued, version_done]
            start_v, end_v = min(versions), max(versions)
            samples.append(
                Sample(
                    token_ids,
                    logprobs,
                    completion.text,
                    str(completion.finish_reason),
                    start_v,
                    end_v,
                    spans,
                    tuple(per_token.tolist()),
                )
            )
        return samples

    async def score_completion(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], *, request_id: str
    ) -> list[float]:
        """`[len(completion)]` logprobs (nats) of the completion tokens given the prompt; `[]` for none.

        One request on prompt + completion with `max_tokens=1, prompt_logprobs=0` (the actual token's logprob per
        position, temperature 1). ValueError: an empty prompt; RuntimeError: no prompt logprobs returned.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if not completion_token_ids:
            return []
        llm = self._require()
        ids = [*prompt_token_ids, *completion_token_ids]
        params = SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )
        final = None
        async for output in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
            final = output
        if final is None or final.prompt_logprobs is None or len(final.prompt_logprobs) != len(ids):
            raise RuntimeError(f"request {request_id} returned no prompt logprobs for its {len(ids)} tokens")
        start = len(prompt_token_ids)
        return [final.prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids))]

    # -- weights ---------------------------------------------------------------------------------

    async def init_weight_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float | None = None
    ) -> None:
        """Join the trainer's broadcast group as `rank` (>= 1); blocks until all ranks joined."""
        await self._require().collective_rpc(
            "init_weight_group", args=(host, port, rank, world_size, backend, timeout_s)
        )

    async def leave_weight_group(self) -> None:
        """Leave the broadcast group (the trainer re-formed it)."""
        await self._require().collective_rpc("destroy_weight_group")

    async def update_weights(
        self, version: int, manifest: list[list], bucket_bytes: int | None = None, *, resend: bool = False
    ) -> float:
        """Receive a broadcast of `manifest` as `version`; seconds paused. `bucket_bytes`: the sender's.

        ValueError (nothing received) if `version <= self.version`, unless `resend` (a re-formed group's first
        broadcast) and equal: joining a collective nobody sends would block forever.
        """
        kwargs = {"manifest": manifest}
        if bucket_bytes is not None:
            kwargs["bucket_bytes"] = bucket_bytes
        return await self.apply_rpc(version, "receive_weights", kwargs, resend=resend)

    async def load_weights_from_path(self, version: int, path: str | Path) -> float:
        """Load a safetensors directory/file (full or LoRA payload) as `version`; seconds paused.

        A lower version is loaded too (a resumed trainer rolled back); ValueError if equal to the current one.
        """
        return await self.apply_rpc(version, "load_weights_from_path", {"path": str(path)})

    async def apply_rpc(
        self, version: int, rpc: str, kwargs: dict, *, resend: bool = False, reports: list | None = None
    ) -> float:
        """Pause, run worker method `rpc(**kwargs)`, tag `version`, resume; returns seconds paused. `reports`
        (the bus method) gets each worker's `{"version": loaded, ...}`, and that version is tagged."""
        llm = self._require()
        async with self._update_lock:
            if (version == self._version and not resend) or (rpc == "receive_weights" and version < self._version):
                raise ValueError(f"version {version} cannot replace current {self._version} by {rpc}")
            start = time.perf_counter()
            # keep: in-flight requests are frozen, resumed (recomputed) under the new weights; wait
            # (drain): they finish first; clear_cache: no KV of the old weights survives, prefix cache included.
            await llm.pause_generation(mode=UPDATE_MODES[self._update_mode], clear_cache=True)
            try:
                out = await llm.collective_rpc(rpc, kwargs=kwargs)
                if reports is not None:  # tensor-parallel workers racing a new version: broken, restarted
                    reports.extend(out)
                    version = out[0]["version"]
                    if any(r["version"] != version for r in out):
                        raise RuntimeError(f"workers loaded different versions {[r['version'] for r in out]}")
                await llm.update_weight_version(str(version))
            except BaseException as e:
                self._broken = f"weight update to version {version} failed: {e!r}"
                raise
            self._version = version
            await llm.resume_generation()
            return time.perf_counter() - start

    def _require(self):
        if self._broken is not None:
            raise RuntimeError(f"RolloutEngine is broken ({self._broken}); close it")
        if self._llm is None:
            raise RuntimeError("RolloutEngine not started")
        return self._llm


def vllm_on_gpu() -> bool:
    """Whether vLLM runs on a GPU here: a CUDA/ROCm platform and a non-empty `CUDA_VISIBLE_DEVICES`."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def device_engine_args(
    *, on_gpu: bool, kv_cache_bytes: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None
) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields that depend on where the engine runs.

    CPU: `{"kv_cache_memory_bytes", "enable_chunked_prefill": False}` (tensor parallelism ignored; a seeded request
    whose prompt a chunked prefill splits kills vLLM 0.32's CPU engine: "CPU Generator does not use offset").
    CUDA: `{"tensor_parallel_size"}` plus `gpu_memory_utilization` (fraction of each GPU, KV cache included) or,
    without it, `kv_cache_memory_bytes`. ValueError: `tensor_parallel_size < 1`, `gpu_memory_utilization` outside
    (0, 1].
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not on_gpu:
        if tensor_parallel_size != 1:
            logger.warning("tensor_parallel_size=%d ignored: vLLM runs on CPU here", tensor_parallel_size)
        return {"kv_cache_memory_bytes": kv_cache_bytes, "enable_chunked_prefill": False}
    if gpu_memory_utilization is None:
        return {"tensor_parallel_size": tensor_parallel_size, "kv_cache_memory_bytes": kv_cache_bytes}
    return {"tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization}


def _ensure_repo_on_pythonpath() -> None:
    """vLLM's spawned workers import WORKER_EXTENSION_CLS: put the repo root on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[1])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def _resolved_dtype(name: str) -> str:
    """`producers.dtype` as vLLM's `dtype` ("auto" resolved here: vLLM's means the checkpoint's); ValueError."""
    from broadcaster.dtypes import resolve_producer_dtype

    if name == "auto":
        import torch

        return resolve_producer_dtype(name, cuda_available=torch.cuda.is_available())
    return resolve_producer_dtype(name, cuda_available=False)
