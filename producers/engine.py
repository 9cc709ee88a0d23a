"""RolloutEngine: the only place in a producer process that touches vLLM.

It wraps one `vllm.v1.engine.async_llm.AsyncLLM` (a spawned EngineCore process, whose Worker runs
inside it on CPU: `producers.vllm_procs`) whose workers carry `broadcaster.worker_extension.WeightSyncExtension`, and offers three
things: generate a group of samples for one prompt, apply new policy weights, report the version.

Policy versions and spans:
- The engine holds one integer policy `version` (`initial_version` at start). vLLM labels every
  engine step's output with its current weight version (`AsyncLLM.update_weight_version`), and a
  finished completion reports `weight_versions`: contiguous `[start, end)` token spans per
  version. `Sample.token_versions` expands them to one version per token (a token no span
  covers gets the version when the request was issued); `Sample.version_start` / `version_end`
  are the min / max of those. Only for a sample without output tokens do they fall back to the
  engine's version when the request was issued and when it finished.
- `update_weights` pauses the scheduler with `mode="keep", clear_cache=True`: in-flight requests
  are frozen, not aborted; the KV and prefix caches are dropped, so on resume those requests are
  recomputed (prefill of prompt + tokens so far) under the NEW weights and continue from there.
  Tokens sampled before the pause keep their old-version logprobs; later tokens carry the new
  version. So a sample with `version_start != version_end` is a partial rollout (off-policy for
  its early tokens). Requests submitted during the update wait and start under the new version.
- With `update_mode="drain"` an update instead waits for the in-flight requests to finish under
  the old weights (vLLM's `mode="wait"`; requests submitted meanwhile queue and start under the new
  version): no recompute and no partial rollout, at the price of the update waiting for the longest
  request in flight (right for short completions; `producers.weight_update`).
- Updates are serialized (one at a time); a failed update leaves the engine paused and marked
  broken (tokens from half-loaded weights must never be tagged with a version); `close()` it.

Tokenizer: none is rendered here; callers pass token ids. `tokenizer` exposes vLLM's (Hugging
Face) tokenizer of the model for decoding/EOS ids; `AutoTokenizer.from_pretrained(model_path)` gives
the same one.

Devices: the engine runs where vLLM's platform is (the CPU build of vLLM: CPU; the CUDA build: the
devices of the process's `CUDA_VISIBLE_DEVICES`, which `busctl up` sets per producer). On CUDA it
takes `tensor_parallel_size` GPUs and, when `gpu_memory_utilization` is given, that fraction of
each GPU's memory with the KV cache sized by vLLM from what is left; without it (the teacher, a
second engine in the same process) the KV cache is `kv_cache_bytes`, as on CPU, where vLLM takes
neither argument (`device_engine_args`).

Logprobs are vLLM's "raw_logprobs" by default: log-softmax of the unmodified logits (before
temperature and top-p), i.e. `log_softmax(model(ids).logits)` on the trainer side. Pass
`engine_kwargs={"logprobs_mode": "processed_logprobs"}` for post-temperature/top-p values; the
trainer must then compute the same quantity.
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
from producers.vllm_procs import engine_core_env

logger = logging.getLogger(__name__)

#: `update_mode` -> vLLM's pause mode for a weight update.
UPDATE_MODES = {"keep": "keep", "drain": "wait"}

#: The worker extension class, importable in vLLM's spawned children (repo root on PYTHONPATH).
WORKER_EXTENSION_CLS = "broadcaster.worker_extension.WeightSyncExtension"


class RolloutEngine:
    """Async wrapper of vLLM's AsyncLLM for GRPO rollouts with in-place weight updates.

    Args:
        model_path: HF model directory (config, safetensors, tokenizer), or a hub id in the local HF
            cache (`configs.model_path.resolve_model_path`; FileNotFoundError if neither).
        max_model_len: prompt + completion limit in tokens.
        seed: engine sampling seed.
        kv_cache_bytes: KV cache size (vLLM otherwise reserves most of RAM on CPU).
        initial_version: policy version of the weights at `model_path`.
        max_num_seqs: most sequences in one engine step.
        warmup: send one short request in `start()` so the first real batch does not pay
            the eager-mode first-batch cost (~3 s on CPU).
        dtype: weights and compute dtype of the engine (`producers.dtype`): "bfloat16",
            "float32", or "auto" (bfloat16 with CUDA, float32 without;
            `broadcaster.dtypes.resolve_producer_dtype`). The trainer sends weights in it.
        busy_loop_s: the most seconds vLLM's inter-process queue readers busy-poll after a read
            (`producers.vllm_idle`; vLLM's own default is 1 s, which keeps a CPU core spinning
            while the producer waits); None keeps vLLM's default.
        tensor_parallel_size: GPUs the engine shards the model over (CUDA only; `producers.tensor_parallel_size`).
        gpu_memory_utilization: fraction (0, 1] of each GPU's memory the engine may take, KV cache
            included (CUDA only; `producers.gpu_memory_utilization`); None: a fixed `kv_cache_bytes`.
        engine_kwargs: extra `AsyncEngineArgs` fields (override the defaults above).
        update_mode: "keep" (in-flight requests are recomputed and continue under new weights) or
            "drain" (an update waits for them); see the module docstring.
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
        self._llm = None
        self._update_lock = None
        self._broken: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> float:
        """Start the engine process(es) (blocks the event loop ~10-15 s on CPU); returns seconds."""
        import asyncio

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is not None:
            raise RuntimeError("RolloutEngine already started")
        start = time.perf_counter()
        _ensure_repo_on_pythonpath()
        if self._busy_loop_s is not None:  # read by producers.vllm_idle in every vLLM process
            os.environ[BUSY_LOOP_ENV] = repr(float(self._busy_loop_s))
        self._update_lock = asyncio.Lock()
        with engine_core_env(on_gpu=self._on_gpu, eager=bool(self._engine_kwargs.get("enforce_eager"))):
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs))
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
            llm.shutdown()

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def update_mode(self) -> str:
        """ "keep" or "drain": how the next weight updates treat requests in flight (module docstring)."""
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
        """Sample `n` completions of one prompt; returns them in sample-index order.

        `request_id` must be unique among in-flight requests. Only the final output is streamed
        back (FINAL_ONLY), which is markedly faster than per-token deltas. `ignore_eos` keeps
        sampling past the end-of-sequence token up to `max_tokens` (benchmarks, tests).
        `min_tokens`: EOS and stop tokens are masked until a sample has this many tokens. `repetition_penalty`: vLLM's (CTRL, arXiv:1909.05858: logits of tokens already in the
        prompt or completion divided by it if > 0, else multiplied; 1 = off).
        `seed`: sample `j` draws from a generator seeded with `seed + j`, so the group is
        reproducible whatever else is batched with it; None: the engine's seed stream. `stop`: strings
        ending a sample (text excludes them; token ids keep every sampled token). `detokenize=False`:
        vLLM decodes nothing (no incremental detokenizer, no per-token strings in the logprobs) and
        each Sample's `text` is "" (for callers that decode the token ids themselves; ~0.04 CPU-s
        less in the calling process per 16 x 8 x 16-token batch on the 2-core CPU host,
        bench/README.md); stop strings need the text, so with `stop` it is always on. Raises
        ValueError for n, max_tokens < 1, min_tokens > max_tokens or an empty prompt.
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
        """Logprob of each completion token under this engine's model, given the prompt.

        One request on `prompt_token_ids + completion_token_ids` with `max_tokens=1,
        prompt_logprobs=0`: vLLM then returns, for every position p >= 1 of the sequence, the
        logprob of the token actually there given the tokens before it (plus its top-0 = none
        others; position 0 has no context and is None). Returns `[len(completion)]` floats (nats)
        in the engine's logprobs_mode (raw: `log_softmax(logits)`, temperature 1); `[]` for an
        empty completion (no request is made). The one sampled token is discarded.
        Raises ValueError for an empty prompt, RuntimeError if vLLM returns no prompt logprobs.
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
        """Join the trainer's broadcast group as `rank` (>= 1); blocks until all ranks joined. Runs
        concurrently with the trainer's `BroadcastSender.init_group()` (either may start first)."""
        await self._require().collective_rpc(
            "init_weight_group", args=(host, port, rank, world_size, backend, timeout_s)
        )

    async def leave_weight_group(self) -> None:
        """Leave the broadcast group of `init_weight_group` (re-formed: `BroadcastReceiver.regroup`)."""
        await self._require().collective_rpc("destroy_weight_group")

    async def update_weights(
        self, version: int, manifest: list[list], bucket_bytes: int | None = None, *, resend: bool = False
    ) -> float:
        """Receive a broadcast of `manifest` as policy `version`; returns seconds spent paused.

        Runs concurrently with the trainer's `BroadcastSender.start_send(state_dict, version)`;
        `bucket_bytes` must match the broadcaster's (None: the shared default). A "lora" manifest
        (an adapter, `broadcaster.manifest`) is merged into the base weights in the worker.
        Raises ValueError, receiving nothing, if `version <= self.version`: a re-announced version
        is not sent again, so joining the collective would block forever. With `resend` (the first
        broadcast into a re-formed group) `version == self.version` is received too.
        """
        kwargs = {"manifest": manifest}
        if bucket_bytes is not None:
            kwargs["bucket_bytes"] = bucket_bytes
        return await self.apply_rpc(version, "receive_weights", kwargs, resend=resend)

    async def load_weights_from_path(self, version: int, path: str | Path) -> float:
        """Load a safetensors directory/file (merged weights, or a LoRA adapter payload) as policy
        `version`; returns seconds spent paused.

        `version` may be lower than the current one (a trainer resumed from a checkpoint rolls the
        policy back); raises ValueError if it equals the current version.
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
    """Whether vLLM runs on a GPU in this process: its platform is CUDA (or ROCm) and
    `CUDA_VISIBLE_DEVICES` is not empty (busctl's "no GPU" for a producer)."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def device_engine_args(
    *, on_gpu: bool, kv_cache_bytes: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None
) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields that depend on where the engine runs.

    Args:
        on_gpu: the engine runs on CUDA (`vllm_on_gpu`).
        kv_cache_bytes: KV-cache size, bytes (always used on CPU; on CUDA only without
            `gpu_memory_utilization`: vLLM's `kv_cache_memory_bytes` overrides the fraction).
        tensor_parallel_size: GPUs per engine (>= 1; not passed on CPU, where a producer is one
            engine process: a run whose producers got no GPU ignores `producers.tensor_parallel_size`).
        gpu_memory_utilization: fraction in (0, 1] of each GPU's memory, or None.

    Returns:
        On CPU `{"kv_cache_memory_bytes"}`; on CUDA `{"tensor_parallel_size"}` plus
        `{"gpu_memory_utilization"}` or `{"kv_cache_memory_bytes"}`.

    Raises:
        ValueError: `tensor_parallel_size` < 1; `gpu_memory_utilization` outside (0, 1].
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not on_gpu:
        if tensor_parallel_size != 1:
            logger.warning("tensor_parallel_size=%d ignored: vLLM runs on CPU here", tensor_parallel_size)
        return {"kv_cache_memory_bytes": kv_cache_bytes}
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
    """`producers.dtype` as vLLM's `dtype` argument ("auto" resolved here, not by vLLM, whose
    "auto" means the checkpoint's dtype). Raises ValueError for an unknown name."""
    from broadcaster.dtypes import resolve_producer_dtype

    if name == "auto":
        import torch

        return resolve_producer_dtype(name, cuda_available=torch.cuda.is_available())
    return resolve_producer_dtype(name, cuda_available=False)
