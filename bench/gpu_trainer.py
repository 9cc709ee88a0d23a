"""rlbus's trainer step against TRL's GRPOTrainer step (and a plain HF step), on the same samples, in one
process: tokens/s, MFU, peak memory and torch.compile graphs on a uniform and a GRPO-shaped batch. No vLLM.

Usage: ``python -m bench.gpu_trainer [--modes fixed,sequence] [--steps 4] [--sequence-steps 8]
[--micro-batch-tokens 16384] [--variants default,trl,trl_liger,...] [--reference trl_liger] [--out F.json]``;
``--cpu-smoke``: tiny shapes on CPU. Without CUDA and without ``--cpu-smoke`` it exits with status 2.

A random Qwen2 of Qwen2.5-0.5B's shape, AdamW, bf16 autocast; float32 master weights, or bfloat16
parameters for a variant named ``NAME+bf16``. rlbus variants (``VARIANTS``) run ``Trainer.step`` on the
packer's micro-batches; the baselines (``bench.gpu_baselines_trl.BASELINES``) are TRL's step. Mode
``fixed`` repeats one batch; ``sequence`` draws a new one per step (bench/gpu_trainer_batches.py). Each
variant: the same fresh weights, one warm-up step, then the timed steps. MFU = 6 N tokens/s / peak (Kaplan
et al. 2020, sec. 2.1). Then each ``lm_head_dtype``'s logprob error against a float64 head. Method and
results: bench/README.md, "GPU trainer against TRL's step".
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench.gpu import QWEN25_05B, SMOKE, build_model, peak_tflops, sync
from bench.gpu_baselines_trl import BASELINES, build_baseline, resolve
from bench.gpu_trainer_batches import samples_of, step_batches

__all__ = ["VARIANTS", "head_precision", "main", "run_variant"]

VARIANTS = {
    "default": {},
    "share": {"share_prefixes": True},
    "no_share": {"share_prefixes": False},
    "head_fp32": {"lm_head_dtype": "float32", "share_prefixes": True},
    "head_fp32_no_share": {"lm_head_dtype": "float32", "share_prefixes": False},
    "head_bf16": {"lm_head_dtype": "bfloat16", "share_prefixes": True},
    "head_bf16_no_share": {"lm_head_dtype": "bfloat16", "share_prefixes": False},
    "ckpt": {"activation_checkpointing": True},
    "ckpt_head_bf16": {"activation_checkpointing": True, "lm_head_dtype": "bfloat16"},
    "compile": {"compile": True},
    "compile_head_bf16": {"compile": True, "lm_head_dtype": "bfloat16"},
}
"""rlbus trainer variants: TrainerConfig fields over the defaults."""

NO_CUDA = "bench/gpu_trainer.py needs a CUDA GPU; `python -m bench.gpu_trainer --cpu-smoke` runs tiny shapes on CPU"
SMOKE_VARIANTS = "hf,trl,trl_logits,trl_liger,default,trl+bf16,trl_logits+bf16,trl_liger+bf16,default+bf16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="fixed", help="comma list of fixed (one batch repeated), sequence (new per step)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant in mode fixed (after one warm-up)")
    p.add_argument("--sequence-steps", type=int, default=8, help="timed steps per variant in mode sequence")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {sorted(VARIANTS)} and baselines {sorted(BASELINES)}, each also as NAME+bf16 "
        f"(bfloat16 parameters); default hf,trl,trl_liger,default (--cpu-smoke: {SMOKE_VARIANTS})",
    )
    p.add_argument("--reference", default="trl_liger", help="the variant each row's ratio is against")
    p.add_argument("--batches", default="uniform,grpo")
    p.add_argument("--seed", type=int, default=0, help="the batches' seed (the same for every variant)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--no-head-precision", action="store_true", help="skip the LM-head precision table")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each variant's timed steps, one profiled step: the top kernels by device time",
    )
    args = p.parse_args(argv)
    args.variants = args.variants or (SMOKE_VARIANTS if args.cpu_smoke else "hf,trl,trl_liger,default")
    return args


def split_name(name: str) -> tuple[str, bool]:
    """``(base, bf16 parameters)`` of a variant name; SystemExit for an unknown one."""
    base, _, suffix = name.partition("+")
    if (base not in VARIANTS and base not in BASELINES) or suffix not in ("", "bf16"):
        raise SystemExit(f"unknown variant {name!r}; known: {sorted(VARIANTS)}, {sorted(BASELINES)}, each +bf16")
    return base, suffix == "bf16"


def graphs() -> int:
    """Graphs Dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_variant(name: str, batches: list[list], args, device, base_state) -> dict:
    """Step time, tokens/s, peak memory and compiled graphs of one variant over `batches` (the first is
    the warm-up), on fresh weights. tokens/s: fixed, a step's tokens / the median step; sequence, all
    timed tokens / all timed seconds (recompiles included, as a run sees them)."""
    from configs.schema import OptimConfig, TrainerConfig
    from packer.assemble import pack_groups
    from trainer.trainer import Trainer

    base, bf16 = split_name(name)
    torch._dynamo.reset()
    if device.type == "cuda":  # the last variant's memory back to the allocator (seconds on a CPU host: skipped)
        gc.collect()
    shape = SMOKE if args.cpu_smoke else QWEN25_05B
    with device:  # random init where it runs (seconds on CPU at 494M parameters), then the shared weights
        model = build_model(shape)
    model.load_state_dict(base_state)
    if bf16:
        model.to(torch.bfloat16)
    model.train()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if base in BASELINES:
        step = build_baseline(base, model, device, np.random.default_rng(args.seed))
        inputs = batches
    else:
        cfg = TrainerConfig(
            device=device.type, dtype="bfloat16", optim=OptimConfig(lr=1e-6, max_grad_norm=1.0), **VARIANTS[base]
        )
        trainer = Trainer(model, cfg)
        packed: dict[int, list] = {}  # the packer's work (another process in a run): before the clock
        for g in batches:
            if id(g) not in packed:
                packed[id(g)] = pack_groups(g, 0, args.micro_batch_tokens)
        inputs = [packed[id(g)] for g in batches]

        def step(mbs) -> float:
            return trainer.step(mbs)["loss"]

    compiled = graphs()
    step(inputs[0])  # warm-up: allocator, Triton autotuning, cuDNN/flash plans, the first compiles
    sync(device)
    warm_graphs = graphs() - compiled
    times = []
    for x in inputs[1:]:
        t0 = time.perf_counter()
        loss = step(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    if args.profile:
        print_profile(name, lambda: step(inputs[-1]), device)
    tokens = [sum(len(ids) for ids, _, _ in samples_of(g)) for g in batches[1:]]
    sequence = len({id(g) for g in batches}) > 1
    cuda = device.type == "cuda"
    return {
        "variant": name,
        "params_dtype": "bfloat16" if bf16 else "float32",
        "source": resolve(base)[1] if base in BASELINES else "rlbus Trainer.step",
        "mode": "sequence" if sequence else "fixed",
        "steps": len(times),
        "tokens": round(statistics.mean(tokens)),
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times) if sequence else tokens[0] / statistics.median(times),
        "loss": float(loss),
        "graphs_warmup": warm_graphs,
        "graphs_timed": graphs() - compiled - warm_graphs,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
    }


def print_profile(label: str, step, device: torch.device, rows: int = 18) -> None:
    """One `step()` under torch.profiler: the `rows` ops with the most self device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- profile: {label}")
    if device.type == "cuda":  # kernels' time against the step's: what is left is the GPU idling on the host
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        print(f"kernels busy {busy:.3f} s of a {wall:.3f} s profiled step ({100 * busy / wall:.0f}%)")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def head_precision(base_state: dict, groups, device, smoke: bool) -> list[dict]:
    """Logprob error of each `trainer.lm_head_dtype` against a float64 LM head, same hidden states.

    The hidden states are the final-norm output of a bf16-autocast forward of one sample (the
    first sample of the first group, every position but the last); the LM head weight is scaled
    so the logits have a standard deviation of 4 (random init gives ~0.6, a near-uniform
    distribution where no precision shows; trained LMs' logits spread over several units).
    Returns one row per head dtype: mean and max |logprob - float64 logprob| (nats) over the
    positions, and the mean k3 KL estimate."""
    from trainer.forward.logprobs import HEAD_DTYPES, linear_logprobs_and_entropy
    from trainer.forward.precision import PrecisionPolicy

    model = build_model(SMOKE if smoke else QWEN25_05B)
    model.load_state_dict(base_state)
    model.to(device).eval()
    ids = torch.from_numpy(samples_of(groups[:1])[0][0].astype(np.int64))[None].to(device)
    with torch.no_grad(), PrecisionPolicy.from_name("bfloat16").autocast(device):
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1].float()
    targets = ids[0, 1:]
    weight = model.get_output_embeddings().weight.detach().float()
    weight = weight * (4.0 / (hidden @ weight.T).std().item())
    ref, _ = linear_logprobs_and_entropy(hidden.double(), weight.double(), None, targets, backend="torch")
    rows = []
    with torch.no_grad():
        for head_dtype in HEAD_DTYPES:
            lp, _ = linear_logprobs_and_entropy(hidden, weight, None, targets, head_dtype=head_dtype)
            diff = lp.double() - ref
            k3 = (torch.exp(-diff) - 1 + diff).mean().item()  # k3 of pi_ref / pi (Schulman 2020)
            rows.append(
                {
                    "head_dtype": head_dtype,
                    "mean_abs_nats": diff.abs().mean().item(),
                    "max_abs_nats": diff.abs().max().item(),
                    "k3": k3,
                }
            )
    return rows


def report_baselines(names: list[str], device: torch.device) -> tuple[list[str], list[dict]]:
    """Prints which baseline runs TRL's/Liger's own functions and which is skipped (and why); returns the
    names that run and the skipped ``{"variant", "reason"}``."""
    run, skipped = [], []
    for name in names:
        base, _ = split_name(name)
        if base not in BASELINES:
            run.append(name)
            continue
        kind, source = resolve(base)
        if kind is None:
            skipped.append({"variant": name, "reason": source})
            print(f"baseline {name}: SKIPPED, {source}")
            continue
        run.append(name)
        what = {"trl": "TRL's own functions", "liger": "Liger's own functions", "own": "this bench's code"}[kind]
        note = (
            " (Liger's torch.compile of its loss math off on CPU)" if kind == "liger" and device.type == "cpu" else ""
        )
        print(f"baseline {name}: ran with {what}: {source}{note}")
    return run, skipped


def print_table(rows: list[dict], reference: str) -> None:
    print(
        f"| mode | batch | variant | tokens/step | step s | tokens/s | vs {reference} | MFU (6N) | graphs | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_gib']:.1f} ({r['reserved_gib']:.1f})" if r["peak_gib"] is not None else "-"
        ratio = f"{r['vs_ref']:.2f}x" if r["vs_ref"] is not None else "-"
        print(
            f"| {r['mode']} | {r['batch']} | {r['variant']} | {r['tokens']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {r['graphs_warmup']}+{r['graphs_timed']} | {mem} |"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        args.micro_batch_tokens = min(args.micro_batch_tokens, 1024)
        torch.set_num_threads(1)  # steadier on a shared host; the numbers only check the script
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"fixed", "sequence"}:
        raise SystemExit(f"unknown modes {modes}: fixed | sequence")
    names, skipped = report_baselines([v for v in args.variants.split(",") if v], device)
    peak = None if args.cpu_smoke else peak_tflops(torch.cuda.get_device_name(device), args.peak_tflops)
    shape = SMOKE if args.cpu_smoke else QWEN25_05B
    base = build_model(shape)
    params = sum(p.numel() for p in base.parameters())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    del base
    rows = []
    for mode in modes:
        steps = args.sequence_steps if mode == "sequence" else args.steps
        for batch in args.batches.split(","):
            batches = step_batches(batch, shape["vocab_size"], args.cpu_smoke, steps, mode == "sequence", args.seed)
            results = {v: run_variant(v, batches, args, device, base_state) for v in names}
            ref = results.get(args.reference)
            for r in results.values():
                r.update(
                    batch=batch,
                    params=params,
                    vs_ref=r["tokens_per_s"] / ref["tokens_per_s"] if ref else None,
                    mfu=6 * params * r["tokens_per_s"] / (peak * 1e12) if peak else None,
                )
                rows.append(r)
    device_name = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(device)
    print(f"device: {device_name}, torch {torch.__version__}, {params / 1e6:.1f}M parameters, peak {peak} TFLOP/s")
    print("tokens/s: fixed, a step's tokens / the median step; sequence, all tokens / all seconds. graphs: Dynamo")
    print("graphs compiled in the warm-up + the timed steps. peak GiB: allocated (reserved by the allocator).")
    print_table(rows, args.reference)
    head = []
    if not args.no_head_precision:
        head = head_precision(
            base_state, step_batches("grpo", shape["vocab_size"], args.cpu_smoke, 0, False)[0], device, args.cpu_smoke
        )
        print("| lm_head_dtype | mean abs logprob error vs float64 (nats) | max | k3 KL |")
        print("|---|---|---|---|")
        for r in head:
            print(f"| {r['head_dtype']} | {r['mean_abs_nats']:.2e} | {r['max_abs_nats']:.2e} | {r['k3']:.2e} |")
    if args.out:
        out = {"device": device_name, "torch": torch.__version__, "rows": rows, "skipped": skipped}
        with open(args.out, "w") as f:
            json.dump({**out, "head_precision": head}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
