"""Weight transfer speed: `BroadcastSender` and `BusSender` vs a raw gloo broadcast of the same bytes.

Usage: ``python -m bench.broadcast [--runs 7] [--models default,qwen2-100m] [--bucket-mb 32]
[--bus-window 2] [--out FILE.json]``

Two processes on this host, gloo over 127.0.0.1: rank 0 plays the trainer, rank 1 a producer that receives as
the vLLM worker extension does (`BucketReceiver`, no engine). Per model, interleaved, after one warm-up, `--runs`
times: a raw `torch.distributed.broadcast` of one flat tensor of the payload's bytes (the floor), the trainer's
`BroadcastSender.send` (split into the trainer thread's `blocked` part and the background `transfer`), the bus
method (`BusSender` served to a `BusFetcher`) and the LoRA adapter payload. Each ratio is the median over runs
of the paired `send / raw` (the shared host's load drifts). Models: "default" (the tiny policy, 1.1M
parameters) and "qwen2-100m" (random Qwen2, 100.3M parameters). Method and results: bench/README.md, "Weight
broadcast".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from broadcaster.dist_broadcast import BroadcastSender
from broadcaster.bus_fetch import DEFAULT_WINDOW, BusFetcher
from broadcaster.bus_method import BusSender
from broadcaster.manifest import DEFAULT_BUCKET_BYTES, build_manifest, manifest_num_bytes
from broadcaster.buckets import BucketReceiver

MODELS = ("default", "qwen2-100m")
TIMEOUT = timedelta(seconds=600)


def build_model(name: str) -> torch.nn.Module:
    """The random HF model of a benchmark row (float32, eval mode)."""
    if name == "default":
        from policies.tiny_model import build_random_policy
        from transformers import AutoModelForCausalLM

        path = build_random_policy(tempfile.mkdtemp(prefix="bench_broadcast_"))
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if name == "qwen2-100m":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            tie_word_embeddings=True,
        )
        return Qwen2ForCausalLM(config).eval()
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def lora_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the default LoRA config's adapters (B randomised: non-zero bytes)."""
    from peft import LoraConfig, get_peft_model

    from configs.schema import LoraSection

    section = LoraSection()
    peft = get_peft_model(
        model,
        LoraConfig(
            r=section.rank,
            lora_alpha=section.alpha,
            lora_dropout=section.dropout,
            target_modules=list(section.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return peft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receiver(
    raw_port: int,
    weights_port: int,
    bus_port: int,
    plan: list[tuple[str, list, int]],
    runs: int,
    bucket_bytes: int,
    bus_window: int,
) -> None:
    """Rank 1: mirror every measurement of rank 0 (see the module docstring)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{raw_port}", rank=1, world_size=2, timeout=TIMEOUT)
    group = stateless_init_torch_distributed_process_group(
        "127.0.0.1", weights_port, 1, 2, backend="gloo", timeout=TIMEOUT
    )
    fetcher = BusFetcher(f"tcp://127.0.0.1:{bus_port}", producer="bench", window=bus_window)
    for _, manifest, num_bytes in plan:
        buffers = BucketReceiver(manifest, bucket_bytes)
        flat = torch.empty(num_bytes // 4, dtype=torch.float32)
        for run in range(runs + 1):
            dist.barrier()
            dist.broadcast(flat, 0)
            dist.barrier()
            buffers.receive(group)
            dist.barrier()  # rank 0 starts serving
            dist.barrier()  # served
            fetcher.fetch(buffers, run + 1, timeout_s=TIMEOUT.total_seconds())
            dist.barrier()  # fetched
    dist.barrier()
    fetcher.close()
    dist.destroy_process_group()


def measure(runs: int, models: list[str], bucket_bytes: int, bus_window: int = DEFAULT_WINDOW) -> list[dict]:
    """Rank 0: build the payloads, start the receiver, time everything; one dict per payload."""
    from trainer.state.model import lora_adapter_state_dict, policy_state_dict

    torch.set_num_threads(1)
    payloads = []
    for name in models:
        model = build_model(name)
        num_params = sum(p.numel() for p in model.parameters())
        payloads.append((name, "full", lambda m=model: policy_state_dict(m), num_params))
        adapted = lora_model(copy.deepcopy(model))
        payloads.append((name, "lora", lambda m=adapted: lora_adapter_state_dict(m), None))
    plan = [
        (f"{m}/{kind}", build_manifest(build()), manifest_num_bytes(build_manifest(build())))
        for m, kind, build, _ in payloads
    ]
    raw_port, weights_port, bus_port = free_port(), free_port(), free_port()
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=receiver, args=(raw_port, weights_port, bus_port, plan, runs, bucket_bytes, bus_window))
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{raw_port}", rank=0, world_size=2, timeout=TIMEOUT)
    sender = BroadcastSender(
        "gloo", "127.0.0.1", weights_port, 2, bucket_bytes=bucket_bytes, timeout_s=TIMEOUT.total_seconds()
    )
    sender.init_group()
    zmq_ctx = zmq.Context()
    bus = BusSender(zmq_ctx, f"tcp://127.0.0.1:{bus_port}", bucket_bytes=bucket_bytes)
    bus.open()
    rows = []
    try:
        for (model, kind, build, num_params), (_, manifest, num_bytes) in zip(payloads, plan, strict=True):
            flat = torch.randn(num_bytes // 4)
            raw, send, blocked, transfer, built, bus_total, bus_blocked = [], [], [], [], [], [], []
            for run in range(runs + 1):  # run 0: warm-up (buffers, connections)
                dist.barrier()
                start = time.perf_counter()
                dist.broadcast(flat, 0)
                raw_s = time.perf_counter() - start
                start = time.perf_counter()
                sd = build()
                built_s = time.perf_counter() - start
                dist.barrier()
                info = sender.send(sd, run + 1)
                dist.barrier()
                start = time.perf_counter()
                bus_info = bus.start_send(sd, run + 1)
                dist.barrier()  # the receiver fetches now
                dist.barrier()  # fetched
                bus_s = time.perf_counter() - start
                if run:
                    bus_total.append(bus_s)
                    bus_blocked.append(bus_info["blocked_s"])
                    raw.append(raw_s)
                    built.append(built_s)
                    send.append(info["send_time_s"])
                    blocked.append(info["blocked_s"])
                    transfer.append(info["transfer_s"])
            rows.append(
                {
                    "model": model,
                    "payload": kind,
                    "num_params": num_params,
                    "num_bytes": num_bytes,
                    "num_tensors": len(manifest),
                    "num_buckets": len(BucketReceiver(manifest, bucket_bytes).buckets),
                    "raw_s": statistics.median(raw),
                    "send_s": statistics.median(send),
                    "blocked_s": statistics.median(blocked),
                    "transfer_s": statistics.median(transfer),
                    "payload_s": statistics.median(built),
                    "ratio": statistics.median(s / r for s, r in zip(send, raw)),
                    "runs": runs,
                    "bus_s": statistics.median(bus_total),
                    "bus_blocked_s": statistics.median(bus_blocked),
                    "bus_ratio": statistics.median(b / r for b, r in zip(bus_total, raw)),
                }
            )
        dist.barrier()
    finally:
        sender.close()
        bus.close()
        zmq_ctx.term()
        dist.destroy_process_group()
        peer.join(timeout=60)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as the markdown table of bench/README.md."""
    full_bytes = {r["model"]: r["num_bytes"] for r in rows if r["payload"] == "full"}
    out = [
        "| model | payload | bytes | tensors / buckets | raw gloo broadcast | BroadcastSender.send | ratio "
        "| trainer thread: payload + start_send | background transfer | bus (pulled over tcp) | bus ratio "
        "| bus: trainer thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['num_bytes'] / 1e6:.2f} MB"
        if r["payload"] == "lora":
            size += f" ({100 * r['num_bytes'] / full_bytes[r['model']]:.1f}% of full)"
        name = r["model"] + (f" ({r['num_params'] / 1e6:.1f}M params)" if r["num_params"] else "")
        out.append(
            f"| {name} | {r['payload']} | {size} | {r['num_tensors']} / {r['num_buckets']} | "
            f"{1e3 * r['raw_s']:.1f} ms | {1e3 * r['send_s']:.1f} ms | {r['ratio']:.2f}x | "
            f"{1e3 * r['payload_s']:.2f} + {1e3 * r['blocked_s']:.1f} ms | {1e3 * r['transfer_s']:.1f} ms | "
            f"{1e3 * r['bus_s']:.1f} ms | {r['bus_ratio']:.2f}x | {1e3 * r['bus_blocked_s']:.1f} ms |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per payload (medians), >= 5 recommended")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="bucket size, MiB")
    parser.add_argument(
        "--bus-window", type=int, default=DEFAULT_WINDOW, help="buckets the bus receiver asks for at once"
    )
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    rows = measure(args.runs, [m for m in args.models.split(",") if m], int(args.bucket_mb * 2**20), args.bus_window)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
