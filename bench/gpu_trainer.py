"""rlbus's trainer step against a plain Hugging Face policy-gradient step, on the same samples, in one
process: tokens/s, MFU and peak memory on a uniform and a GRPO-shaped batch. Needs no vLLM.

Usage: ``python -m bench.gpu_trainer [--steps 4] [--micro-batch-tokens 16384] [--peak-tflops F]
[--variants default,no_share,head_bf16] [--out FILE.json]``; ``--cpu-smoke``: tiny shapes on CPU. Without
CUDA and without ``--cpu-smoke`` it exits with status 2.

A random Qwen2 of Qwen2.5-0.5B's shape, float32 master weights, AdamW, bf16 autocast. ``hf`` is the step TRL's
GRPOTrainer computes (per group of 8, right-padded, full logits, float32 log-softmax); the rlbus variants run
``Trainer.step`` on the packer's micro-batches with the defaults or one setting changed (shared prefixes, head
dtype, activation checkpointing, ``trainer.compile``). Each variant: same fresh weights, one warm-up step, then
``--steps`` timed; the median step. MFU = 6 N tokens/s / peak (Kaplan et al. 2020, sec. 2.1). Then each
``lm_head_dtype``'s logprob error against a float64 head. Method and results: bench/README.md, "GPU trainer
against a plain HF step".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench.gpu import QWEN25_05B, SMOKE, build_model, peak_tflops, sync

__all__ = ["VARIANTS", "head_precision", "hf_step", "main", "make_groups", "run_variant"]

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

GROUP = 8
NO_CUDA = "bench/gpu_trainer.py needs a CUDA GPU; `python -m bench.gpu_trainer --cpu-smoke` runs tiny shapes on CPU"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (after one warm-up)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument(
        "--variants", default="default,no_share,head_fp32,head_bf16", help=f"comma list of {sorted(VARIANTS)}"
    )
    p.add_argument("--batches", default="uniform,grpo")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each rlbus variant's timed steps, one profiled step: the top kernels by device time",
    )
    return p.parse_args(argv)


def make_groups(kind: str, vocab: int, smoke: bool, rng: np.random.Generator) -> list:
    """The batch as scored groups (random ids, advantages +-1): grpo, GROUP completions of one
    prompt per group; uniform, one sample per group (distinct prompts)."""
    from tests.scored_groups import scored

    if kind == "uniform":
        prompt, lengths = (16, [16] * 16) if smoke else (256, [256] * 64)
        prompts = len(lengths) // GROUP
        comps = [lengths[g * GROUP : (g + 1) * GROUP] for g in range(prompts)]
        shared = False
    elif kind == "grpo":
        prompt, prompts, lo, hi = (32, 2, 8, 64) if smoke else (256, 8, 32, 1024)
        comps = [list(rng.integers(lo, hi + 1, GROUP)) for _ in range(prompts)]
        shared = True
    else:
        raise ValueError(f"unknown batch {kind!r}: uniform | grpo")
    groups = []
    for g, lens in enumerate(comps):
        head = rng.integers(0, vocab, prompt)
        samples = []
        for n in lens:
            ids = np.concatenate([head if shared else rng.integers(0, vocab, prompt), rng.integers(0, vocab, n)])
            samples.append((ids[:prompt], ids[prompt:], float(rng.choice([-1.0, 1.0]))))
        units = [samples] if shared else [[s] for s in samples]
        for k, unit in enumerate(units):
            groups.append(
                scored(
                    f"g{g}" if shared else f"g{g}-{k}",
                    unit[0][0],
                    [c for _, c, _ in unit],
                    advantages=[a for _, _, a in unit],
                    rewards=[1.0] * len(unit),
                    logprobs=[np.full(len(c), -np.log(vocab), np.float32) for _, c, _ in unit],
                )
            )
    return groups


def samples_of(groups) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """``(prompt + completion ids, loss mask, advantage)`` of every sample, in group order."""
    from tests.scored_groups import sample_tokens

    return [(*sample_tokens(g, j), float(g.advantages[j])) for g in groups for j in range(g.group_size)]


def hf_step(model, optimizer, groups, device, precision) -> float:
    """One plain HF policy-gradient step (see the module docstring); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    samples = samples_of(groups)
    loss_tokens = sum(int(mask.sum()) for _, mask, _ in samples)
    total = 0.0
    for start in range(0, len(samples), GROUP):
        group = samples[start : start + GROUP]
        width = max(len(ids) for ids, _, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        adv = torch.tensor([a for _, _, a in group])
        for i, (sample_ids, loss_mask, _) in enumerate(group):
            n = len(sample_ids)
            ids[i, :n], attn[i, :n], mask[i, :n] = (
                torch.from_numpy(sample_ids.astype(np.int64)),
                1,
                torch.from_numpy(loss_mask),
            )
        ids, attn, mask, adv = ids.to(device), attn.to(device), mask.to(device), adv.to(device)
        with precision.autocast(device):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(adv[:, None] * logp * mask[:, 1:]).sum() / loss_tokens
        loss.backward()
        total += loss.item()
        del logits, logp, loss
    optimizer.step()
    return total


def run_variant(name: str, groups, args, device, base_state) -> dict:
    """Median step time, tokens/s and peak memory of one variant on `groups` (fresh weights)."""
    from configs.schema import OptimConfig, TrainerConfig
    from packer.assemble import pack_groups
    from trainer.forward.precision import PrecisionPolicy
    from trainer.trainer import Trainer

    shape = SMOKE if args.cpu_smoke else QWEN25_05B
    with device:  # random init where it runs (seconds on CPU at 494M parameters), then the shared weights
        model = build_model(shape)
    model.load_state_dict(base_state)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if name == "hf":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        precision = PrecisionPolicy.from_name("bfloat16")

        def step() -> float:
            return hf_step(model, optimizer, groups, device, precision)
    else:
        cfg = TrainerConfig(
            device=device.type, dtype="bfloat16", optim=OptimConfig(lr=1e-6, max_grad_norm=1.0), **VARIANTS[name]
        )
        trainer = Trainer(model, cfg)
        mbs = pack_groups(groups, 0, args.micro_batch_tokens)

        def step() -> float:
            return trainer.step(mbs)["loss"]

    step()  # warm-up: allocator, Triton autotuning, cuDNN/flash plans
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    if args.profile and name != "hf":
        print_profile(f"{name}", step, device)
    tokens = sum(len(ids) for ids, _, _ in samples_of(groups))
    step_s = statistics.median(times)
    out = {
        "variant": name,
        "tokens": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "loss": float(loss),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    return out


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


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        args.micro_batch_tokens = min(args.micro_batch_tokens, 1024)
        torch.set_num_threads(1)  # steadier on a shared host; the numbers only check the script
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    peak = None if args.cpu_smoke else peak_tflops(torch.cuda.get_device_name(device), args.peak_tflops)
    shape = SMOKE if args.cpu_smoke else QWEN25_05B
    base = build_model(shape)
    params = sum(p.numel() for p in base.parameters())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    del base
    rows = []
    for batch in args.batches.split(","):
        groups = make_groups(batch, shape["vocab_size"], args.cpu_smoke, np.random.default_rng(0))
        results = {v: run_variant(v, groups, args, device, base_state) for v in ["hf", *names]}
        for v, r in results.items():
            r.update(
                batch=batch,
                params=params,
                vs_hf=r["tokens_per_s"] / results["hf"]["tokens_per_s"],
                mfu=6 * params * r["tokens_per_s"] / (peak * 1e12) if peak else None,
            )
            rows.append(r)
    device_name = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(device)
    print(f"device: {device_name}, torch {torch.__version__}, {params / 1e6:.1f}M parameters, peak {peak} TFLOP/s")
    print("| batch | variant | tokens | step s | tokens/s | vs plain HF | MFU (6N) | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(
            f"| {r['batch']} | {r['variant']} | {r['tokens']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['vs_hf']:.2f}x | {mfu} | {mem} |"
        )
    head = head_precision(
        base_state,
        make_groups("grpo", shape["vocab_size"], args.cpu_smoke, np.random.default_rng(0)),
        device,
        args.cpu_smoke,
    )
    print("| lm_head_dtype | mean abs logprob error vs float64 (nats) | max | k3 KL |")
    print("|---|---|---|---|")
    for r in head:
        print(f"| {r['head_dtype']} | {r['mean_abs_nats']:.2e} | {r['max_abs_nats']:.2e} | {r['k3']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": device_name, "torch": torch.__version__, "rows": rows, "head_precision": head}, f, indent=1
            )
    return rows


if __name__ == "__main__":
    main()
