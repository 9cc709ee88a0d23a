"""Shared-prefix forward on CPU: the trainer's packed forward + backward with `share_prefixes` on vs off.

Run: `python -m bench.shared_prefix_speed` (options: `--help`). Per batch shape it builds one step's GRPO groups
(G completions of one prompt), packs them with `packer.assemble.pack_groups` and times one forward + backward
through `trainer.forward.packed.PackedLogprobs` (loss sum(advantage * logprob) / loss tokens; no optimizer
step). Runs alternate on/off/off/on; medians over `--repeats` after a warm-up; both settings must give the same
summed logprob (rtol 1e-4) and gradient norm (rtol 1e-3). Shapes: `default` (the default job on its tiny
policy), `grpo` (4 x 8 completions of 16-256 tokens) and `grpo_gpu` (issue 28's GPU shape on Qwen2.5-0.5B's,
with `--device cuda --model qwen2-0.5b --dtype bfloat16`). `--gathers` also times indexing, `index_select` and
split + cat for the fan-out `[T_c, H]` -> `[R, H]`. Results: bench/README.md, "Shared-prefix speed".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.forward.packed import PackedLogprobs
from trainer.forward.precision import PrecisionPolicy
from trainer.forward.shared_prefix import plan_shared_prefixes


@dataclass(frozen=True)
class Shape:
    """One step's batch: `num_prompts` groups of `group_size` samples, lengths in tokens (inclusive ranges)."""

    name: str
    num_prompts: int
    group_size: int
    prompt_lens: tuple[int, int]
    completion_lens: tuple[int, int]
    budget: int


SHAPES = {
    "default": Shape("default", 8, 8, (40, 47), (1, 16), 2048),
    "grpo": Shape("grpo", 4, 8, (128, 128), (16, 256), 4096),
    "grpo_gpu": Shape("grpo_gpu", 8, 8, (256, 256), (32, 1024), 16384),
}
TEMPLATE_TOKENS = 10
"""Tokens every prompt opens with (a chat template's `<|im_start|>user\\n`-like start)."""


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch: `input_ids [T]`, `seq_lens [S]`, loss `tokens [T]` bool, `advantages [T]` float32."""

    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    tokens: torch.Tensor
    advantages: torch.Tensor


def step_batches(shape: Shape, vocab: int, seed: int = 0, device: str = "cpu") -> list[MicroBatch]:
    """One step's micro-batches of `shape`, packed by the packer (`packer.assemble.pack_groups`)."""
    from packer.assemble import pack_groups
    from tests.scored_groups import scored

    rng = np.random.default_rng(seed)
    template = rng.integers(0, vocab, TEMPLATE_TOKENS)
    groups = []
    for g in range(shape.num_prompts):
        prompt = np.concatenate(
            [template, rng.integers(0, vocab, int(rng.integers(*shape.prompt_lens, endpoint=True)) - TEMPLATE_TOKENS)]
        )
        advantages = rng.standard_normal(shape.group_size)
        comps = [rng.integers(0, vocab, int(rng.integers(*shape.completion_lens, endpoint=True))) for _ in advantages]
        groups.append(scored(f"g{g}", prompt, comps, advantages=advantages))
    tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return [
        MicroBatch(
            input_ids=tensor(mb.input_ids.astype(np.int64)),
            seq_lens=tensor(mb.seq_lens.astype(np.int64)),
            tokens=tensor(mb.loss_mask),
            advantages=tensor(np.where(mb.loss_mask, mb.advantages, 0.0).astype(np.float32)),
        )
        for mb in pack_groups(groups, 0, shape.budget)
    ]


def run_step(
    packed: PackedLogprobs, batches: list[MicroBatch], precision: PrecisionPolicy
) -> tuple[float, float, float, int]:
    """(seconds, summed logprob, gradient norm, decoder tokens) of one step's forward + backward."""
    packed.model.zero_grad(set_to_none=True)
    loss_tokens = sum(int(mb.tokens.sum()) for mb in batches)
    device = batches[0].input_ids.device
    sums, decoder_tokens = [], 0
    _synchronize(device)
    start = time.perf_counter()
    for mb in batches:
        with precision.autocast(device):
            logprobs, _entropy = packed(mb.input_ids, mb.seq_lens, mb.tokens)
        ((logprobs * mb.advantages).sum() / loss_tokens).backward()
        sums.append(logprobs.detach().sum())
        decoder_tokens += int(packed.stats["decoder_tokens"])
    _synchronize(device)
    seconds = time.perf_counter() - start
    total = float(sum(sums))
    norm = float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in packed.model.parameters() if p.grad is not None]))
    )
    return seconds, total, norm, decoder_tokens


def profile_step(model: torch.nn.Module, shape: Shape, precision: PrecisionPolicy) -> None:
    """Print the 15 ops with the most self time (device time on CUDA) of one step, shared off and on."""
    device = next(model.parameters()).device
    batches = step_batches(shape, model.config.vocab_size, device=str(device))
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for share in (False, True):
        packed = PackedLogprobs(model, share_prefixes=share)
        with torch.profiler.profile() as prof:
            run_step(packed, batches, precision)
        print(f"share_prefixes={share}")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=60))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_shape(model: torch.nn.Module, shape: Shape, repeats: int, precision: PrecisionPolicy) -> dict:
    """Medians over `repeats` alternating runs of shared on and off (after one warm-up run each)."""
    device = next(model.parameters()).device
    batches = step_batches(shape, model.config.vocab_size, device=str(device))
    modules = {share: PackedLogprobs(model, share_prefixes=share) for share in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    results = {}
    for rep in range(repeats + 1):
        for share in (True, False) if rep % 2 else (False, True):
            seconds, total, norm, decoder_tokens = run_step(modules[share], batches, precision)
            results[share] = (total, norm, decoder_tokens)
            if rep:
                times[share].append(seconds)
    (lp_off, norm_off, _), (lp_on, norm_on, dec_on) = results[False], results[True]
    rtol = 1e-4 if not precision.mixed else 1e-2  # bfloat16: 8 mantissa bits, rounded in a different order
    assert abs(lp_on - lp_off) <= rtol * abs(lp_off), (lp_on, lp_off)
    assert abs(norm_on - norm_off) <= 10 * rtol * norm_off, (norm_on, norm_off)
    return {
        "tokens": sum(len(mb.input_ids) for mb in batches),
        "decoder_tokens": dec_on,
        "micro_batches": len(batches),
        "off": statistics.median(times[False]),
        "on": statistics.median(times[True]),
        "off_all": times[False],
        "on_all": times[True],
    }


def time_gathers(shape: Shape, hidden_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of forward + backward of each fan-out of `[T_c, H]` to the loss rows `[R, H]`."""
    mb = step_batches(shape, 256)[0]
    plan = plan_shared_prefixes(mb.input_ids, mb.seq_lens)
    assert plan is not None
    is_first = torch.zeros(len(mb.input_ids), dtype=torch.bool)
    is_first[torch.cumsum(mb.seq_lens, 0) - mb.seq_lens] = True
    rows = torch.nonzero(mb.tokens & ~is_first).flatten() - 1
    idx = plan.expand[rows]
    pieces = _slice_fanout(plan.expand, rows)
    x = torch.randn(len(plan.row_ids), hidden_size, requires_grad=True)
    grad = torch.randn(len(rows), hidden_size)

    def fanout_slices(h):
        parts = h.split(pieces["split"])
        return torch.cat([parts[i] for i in pieces["order"]]).index_select(0, pieces["rows"])

    ways = {
        "x[idx] (index_put_ accumulate)": lambda h: h[idx],
        "x.index_select(0, idx) (index_add_)": lambda h: h.index_select(0, idx),
        "split + cat slices, then index_select": fanout_slices,
    }
    out = {}
    for name, fn in ways.items():
        assert torch.equal(fn(x), x[idx])
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(10):
                x.grad = None
                fn(x).backward(grad)
            samples.append((time.perf_counter() - start) / 10)
        out[name] = statistics.median(samples)
    return out


def _slice_fanout(expand: torch.Tensor, rows: torch.Tensor) -> dict:
    """Split sizes of the compressed row into maximal runs that `expand` reads contiguously, the
    order to concatenate them in to rebuild `[T, H]`, and the loss rows to read from that."""
    e = expand.numpy()
    breaks = np.flatnonzero(np.diff(e) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(e)]])
    cuts = sorted({0, int(e.max()) + 1} | {int(e[s]) for s in starts} | {int(e[t - 1]) + 1 for t in ends})
    split = np.diff(cuts).tolist()
    piece_of = {c: i for i, c in enumerate(cuts[:-1])}
    order = []
    for s, t in zip(starts, ends):
        a, b = int(e[s]), int(e[t - 1]) + 1
        while a < b:
            i = piece_of[a]
            order.append(i)
            a += split[i]
    return {"split": split, "order": order, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["default", "grpo"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each setting (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the default job's trainer: 1)")
    parser.add_argument("--gathers", action="store_true", help="also time the fan-out formulations")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "qwen2-0.5b"],
        help="the default tiny policy, or Qwen2.5-0.5B's shape (random)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="trainer.dtype")
    parser.add_argument(
        "--profile", action="store_true", help="also print the top ops of one step each way (torch.profiler)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precision = PrecisionPolicy.from_name(args.dtype)
    model = build_model(args.model, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} thread(s)"
    print(
        f"torch {torch.__version__}, {where}, {args.model} "
        f"{sum(p.numel() for p in model.parameters()):,} params, {args.dtype}"
    )
    print()
    print("| shape | tokens | decoder tokens shared | micro-batches | off (s) | on (s) | off / on |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        r = time_shape(model, SHAPES[name], args.repeats, precision)
        print(
            f"| {name} | {r['tokens']} | {r['decoder_tokens']} | {r['micro_batches']} | {r['off']:.3f} | {r['on']:.3f} "
            f"| {r['off'] / r['on']:.2f} |",
            flush=True,
        )
        print(f"<!-- {name}: off {[round(t, 3) for t in r['off_all']]} on {[round(t, 3) for t in r['on_all']]} -->")
        if args.profile:
            profile_step(model, SHAPES[name], precision)
    if args.gathers:
        print()
        print("| shape | fan-out `[T_c, H]` -> `[R, H]`, forward + backward | ms |")
        print("|---|---|---|")
        for name in args.shapes:
            for way, seconds in time_gathers(SHAPES[name], model.config.hidden_size, args.repeats).items():
                print(f"| {name} | {way} | {seconds * 1e3:.3f} |", flush=True)


def build_model(name: str, device: str) -> torch.nn.Module:
    """The default tiny policy (`policies.tiny_model.build_random_policy`, loaded as the trainer loads
    it), or a random model of Qwen2.5-0.5B's shape; float32, sdpa, train mode, on `device`."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if name == "qwen2-0.5b":
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        with torch.device(device):
            return Qwen2ForCausalLM(config).train()
    from policies.tiny_model import build_random_policy

    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_policy(Path(tmp) / "policy")
        return (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
            .to(device)
            .train()
        )


if __name__ == "__main__":
    main()
