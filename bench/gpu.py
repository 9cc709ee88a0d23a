"""GPU throughput of a ~0.5B random Qwen-architecture policy: trainer tokens/s and MFU, producer
tokens/s, weight sync time.

Usage: ``python -m bench.gpu [--peak-tflops F] [--steps 5] [--micro-batch-tokens 8192]
[--micro-batches 4] [--prompts 256] [--gen-tokens 256] [--sync-runs 3] [--out FILE.json]``
(``--cpu-smoke``: a tiny shape end to end on CPU, numbers meaningless); without CUDA it exits 2.

Qwen2.5-0.5B's shape (494M parameters) with random weights, on cuda:0 (with 2+ GPUs the trainer on cuda:1): a
vLLM engine generating for random prompts (tokens/s after a warm-up); the bf16 `Trainer` on packed micro-batches
(MFU = 6 N tokens/s / peak: Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1, attention's T^2 FLOPs not counted,
so slightly under); and the weight sync into the engine (NCCL with 2+ GPUs, else gloo), median of
`--sync-runs`. Results: bench/README.md, "GPU".
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}
"""bf16 dense tensor-core peak TFLOP/s by device-name fragment, first match wins (NVIDIA data
sheets: H100 SXM 989.4, PCIe 756, NVL 835; H200 989.4; A100 312)."""

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
)
SMOKE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)
NO_CUDA = (
    "bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
    "`python -m bench.gpu --cpu-smoke` runs a tiny shape on CPU to check the script"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (checks the script)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak, TFLOP/s (default: PEAK_TFLOPS)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--sync-runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.steps, args.micro_batch_tokens, args.micro_batches = 2, 256, 2
        args.prompts, args.gen_tokens, args.sync_runs = 4, 8, 2
    for name in ("steps", "micro_batch_tokens", "micro_batches", "prompts", "gen_tokens", "sync_runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def peak_tflops(device_name: str, given: float | None) -> float | None:
    """`given`, else the `PEAK_TFLOPS` entry whose fragment is in `device_name`, else None."""
    if given is not None:
        return given
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def build_model(shape: dict, seed: int = 0) -> torch.nn.Module:
    """A random float32 Qwen2ForCausalLM of `shape` (sdpa attention), on CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa"))


def random_micro_batches(vocab: int, tokens: int, count: int, sample_len: int, rng: np.random.Generator) -> list:
    """`count` packed micro-batches of `tokens // sample_len` random samples each (half prompt)."""
    from tests.scored_groups import packed_step, scored

    per_mb = max(1, tokens // sample_len)
    half = sample_len // 2
    groups = []
    for m in range(count):
        for k in range(per_mb):
            ids = rng.integers(0, vocab, sample_len).astype(np.int32)
            groups.append(
                scored(
                    f"g{m}-{k}",
                    ids[:half],
                    [ids[half:]],
                    advantages=[float(rng.choice([-1.0, 1.0]))],
                    rewards=[1.0],
                    logprobs=[np.full(sample_len - half, -np.log(vocab), np.float32)],
                )
            )
    return packed_step(groups, [range(m * per_mb, (m + 1) * per_mb) for m in range(count)])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_trainer(model: torch.nn.Module, args, device: torch.device, peak: float | None) -> dict:
    """Trainer tokens/s and MFU over `args.steps` optimizer steps (after one warm-up step)."""
    from configs.schema import OptimConfig, TrainerConfig
    from trainer.trainer import Trainer

    cfg = TrainerConfig(device=device.type, dtype="bfloat16", optim=OptimConfig(lr=1e-5, max_grad_norm=1.0))
    trainer = Trainer(model, cfg)
    rng = np.random.default_rng(0)
    sample_len = 32 if args.cpu_smoke else 512
    mbs = random_micro_batches(model.config.vocab_size, args.micro_batch_tokens, args.micro_batches, sample_len, rng)
    tokens = sum(len(mb.input_ids) for mb in mbs)
    trainer.step(mbs)  # warm-up: allocator, autotuning of the Triton kernels
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        stats = trainer.step(mbs)
    sync(device)
    seconds = time.perf_counter() - start
    tps = tokens * args.steps / seconds
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "tokens_per_step": tokens,
        "step_s": seconds / args.steps,
        "tokens_per_s": tps,
        "mfu": 6 * params * tps / (peak * 1e12) if peak else None,
        "last_loss": stats["loss"],
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def start_engine(model_dir: Path, cpu: bool):
    """A vLLM `LLM` over `model_dir` with rlbus's worker extension (token-id prompts only)."""
    from vllm import LLM

    from producers.engine import WORKER_EXTENSION_CLS, _ensure_repo_on_pythonpath
    from producers.vllm_procs import engine_core_env

    _ensure_repo_on_pythonpath()
    memory = {"kv_cache_memory_bytes": 64 * 2**20} if cpu else {"gpu_memory_utilization": 0.35}
    with engine_core_env(on_gpu=not cpu):  # CPU: the engine and its worker in this process, nothing spawned
        return LLM(
            model=str(model_dir),
            dtype="float32" if cpu else "bfloat16",
            skip_tokenizer_init=True,
            worker_extension_cls=WORKER_EXTENSION_CLS,
            max_model_len=1024,
            enforce_eager=cpu,
            seed=0,
            **memory,
        )


def bench_producer(llm, vocab: int, args) -> dict:
    """Generated tokens/s of one `generate` call over `args.prompts` random 128-token prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(1)
    prompt_len = 16 if args.cpu_smoke else 128
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(0, vocab, prompt_len).tolist()) for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True, detokenize=False, temperature=1.0)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompts": len(prompts),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
    }


def bench_weight_sync(llm, model: torch.nn.Module, backend: str, dtype: torch.dtype, runs: int) -> dict:
    """Median seconds to cast the trainer's weights to `dtype` and broadcast them into the engine."""
    from broadcaster.dist_broadcast import BroadcastSender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = BroadcastSender(backend, "127.0.0.1", port, 2, timeout_s=300)
    device = next(model.parameters()).device

    def on_device(fn, *args):  # the current CUDA device is per thread: the sender's buffers go there
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return fn(*args)

    joined = threading.Thread(target=on_device, args=(sender.init_group,))
    joined.start()
    llm.collective_rpc("init_weight_group", args=("127.0.0.1", port, 1, 2, backend, 300))
    joined.join()
    times, num_bytes = [], 0
    try:
        for version in range(1, runs + 1):
            start = time.perf_counter()
            payload = {name: t.detach().to(dtype) for name, t in model.state_dict().items()}
            manifest = sender.manifest(payload)
            sent = threading.Thread(target=on_device, args=(sender.start_send, payload, version, manifest))
            sent.start()
            llm.collective_rpc("receive_weights", kwargs={"manifest": manifest})
            sent.join()
            info = sender.wait()
            times.append(time.perf_counter() - start)
            num_bytes = info["num_bytes"]
    finally:
        sender.close()
    return {"backend": backend, "bytes": num_bytes, "seconds_median": statistics.median(times), "seconds": times}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    on_gpu = cuda and not args.cpu_smoke
    shape = SMOKE if args.cpu_smoke else QWEN25_05B
    gpus = torch.cuda.device_count() if on_gpu else 0
    trainer_device = torch.device("cuda", 1 if gpus >= 2 else 0) if on_gpu else torch.device("cpu")
    name = torch.cuda.get_device_name(trainer_device) if on_gpu else "cpu"
    peak = peak_tflops(name, args.peak_tflops)
    results: dict = {"device": name, "gpus": gpus, "shape": shape, "peak_tflops": peak}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(shape)
        model.save_pretrained(tmp)
        llm = start_engine(Path(tmp), cpu=not on_gpu)
        try:
            results["producer"] = bench_producer(llm, shape["vocab_size"], args)
            if on_gpu:
                torch.cuda.set_device(trainer_device)
            model = model.to(trainer_device).train()
            results["trainer"] = bench_trainer(model, args, trainer_device, peak)
            backend = "nccl" if gpus >= 2 else "gloo"
            dtype = torch.bfloat16 if on_gpu else torch.float32
            results["weight_sync"] = bench_weight_sync(llm, model, backend, dtype, args.sync_runs)
        finally:
            llm.llm_engine.engine_core.shutdown()  # the engine-core process (LLM has no close())
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
