"""Peak trainer memory per parameter (CPU RSS) with FSDP2 vs DDP, at 1 and 2 ranks.

Each configuration runs under a real torchrun (gloo, one torch thread per rank): every rank
builds a random ~100M-parameter Qwen3-architecture model in float32 (``--vocab``, ``--hidden``,
``--layers``), wraps it in :class:`trainer.trainer.Trainer` with the configuration's
``trainer.parallel`` and ``trainer.dtype`` (:meth:`Trainer.enable_data_parallel`: FSDP2 shards
it, DDP replicates it), and trains ``--steps`` optimizer steps of ``--micro-batches`` random
packed micro-batches of ``--tokens`` tokens per rank (4 samples each; AdamW, so its two moments
exist from the first step on). Per rank it reports

    bytes/param = (VmHWM at the end - VmRSS before the model was built) / parameters

(``/proc/self/status``: VmHWM is the process's peak resident set), and the bytes of weights,
gradients and AdamW state it holds at the end (local shards), per parameter. The RSS counts everything the
trainer allocates for the model: weights, gradients, AdamW moments, activations of one
micro-batch, communication buffers, and (fsdp) the full float32 model each rank builds before
``fully_shard`` keeps its shard; allocator caching included. Expected for float32 on one rank:
~16 B/param (weights 4 + grads 4 + AdamW 8) plus activations; FSDP at W ranks divides the
sharded part by W.

    python -m bench.fsdp_memory                         # the table in bench/README.md
    python -m bench.fsdp_memory --configs fsdp:bfloat16:2 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = "fsdp:bfloat16:1,fsdp:bfloat16:2,ddp:float32:1,ddp:float32:2"


def status_kib(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/self/status, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field} (Linux only)")


def random_micro_batches(step: int, rank: int, num: int, tokens: int, vocab: int) -> list:
    """``num`` micro-batches of ``tokens`` tokens (4 samples each: prompt 1/4, completion 3/4)."""
    import numpy as np

    from tests.scored_groups import packed_step, scored

    rng = np.random.default_rng(1000 * step + rank)
    per = tokens // 4
    head = per // 4
    groups = []
    for m in range(num):
        for k in range(4):
            ids = rng.integers(0, vocab, per).astype(np.int32)
            lp = -rng.random(per)[head:]
            groups.append(
                scored(
                    f"g{step}-{rank}-{m}-{k}",
                    ids[:head],
                    [ids[head:]],
                    version=step,
                    advantages=[float(rng.normal())],
                    logprobs=[lp],
                )
            )
    return packed_step(groups, [range(4 * m, 4 * m + 4) for m in range(num)], step=step)


def model_state_bytes(trainer) -> int:
    """Bytes this rank holds in weights, gradients and optimizer state (local shards of DTensors;
    DDP's gradient buckets not counted): the exact model-state part of the RSS."""
    from torch.distributed.tensor import DTensor

    def local(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = 0
    for p in trainer.model.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
        total += sum(local(v) for v in trainer.optimizer.state.get(p, {}).values() if hasattr(v, "numel"))
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: build, wrap, train, write its measurement to ``args.out``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from configs.schema import OptimConfig, TrainerConfig
    from trainer.parallel.distributed import DataParallel
    from trainer.trainer import Trainer

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    dp = DataParallel.from_env("gloo", 1800.0, world_size=world)
    cfg = TrainerConfig(data_parallel=world, parallel=args.parallel, dtype=args.dtype, optim=OptimConfig(lr=1e-5))
    before = status_kib("VmRSS")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model, cfg)
    trainer.enable_data_parallel(dp)
    built = status_kib("VmHWM")
    for step in range(args.steps):
        metrics = trainer.step(random_micro_batches(step, dp.rank, args.micro_batches, args.tokens, args.vocab))
    peak = status_kib("VmHWM")
    state_bytes = model_state_bytes(trainer)
    result = {
        "rank": dp.rank,
        "world": world,
        "parallel": args.parallel,
        "dtype": args.dtype,
        "params": params,
        "rss_before_mib": before / 1024,
        "peak_after_wrap_mib": built / 1024,
        "peak_mib": peak / 1024,
        "bytes_per_param": (peak - before) * 1024 / params,
        "state_bytes_per_param": state_bytes / params,
        "loss": metrics["loss"],
    }
    Path(args.out).with_suffix(f".rank{dp.rank}.json").write_text(json.dumps(result))
    trainer.disable_data_parallel()
    if not dp.is_leader:
        dp.recv_step()  # rank 0's stop (sent by its close): every rank leaves together
    dp.close()


def run_config(spec: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Run one ``parallel:dtype:ranks`` configuration under torchrun; its per-rank results."""
    parallel, dtype, ranks = spec.split(":")
    out = tmp / spec.replace(":", "_")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        ranks,
        "-m",
        "bench.fsdp_memory",
        "--worker",
        "--parallel",
        parallel,
        "--dtype",
        dtype,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--micro-batches",
        str(args.micro_batches),
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, cwd=REPO_ROOT, check=True)
    return [json.loads(p.read_text()) for p in sorted(tmp.glob(out.name + ".rank*.json"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated parallel:dtype:ranks")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank and step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parallel", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.configs.split(","):
            rows += run_config(spec, args, Path(tmp))
    print(
        f"{rows[0]['params'] / 1e6:.1f}M parameters; {args.steps} steps x {args.micro_batches} micro-batches x "
        f"{args.tokens} tokens per rank\n"
    )
    print(
        "| parallel | trainer.dtype | ranks | rank | peak after build + wrap (MiB) "
        "| peak RSS - RSS before the model (MiB) | peak RSS bytes/param | weights + grads + AdamW held, bytes/param |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['parallel']} | {r['dtype']} | {r['world']} | {r['rank']} "
            f"| {r['peak_after_wrap_mib'] - r['rss_before_mib']:.0f} | {r['peak_mib'] - r['rss_before_mib']:.0f} "
            f"| {r['bytes_per_param']:.1f} | {r['state_bytes_per_param']:.1f} |"
        )


if __name__ == "__main__":
    main()
