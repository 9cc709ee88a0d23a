"""Training throughput: the trainer's packed forward against a right-padded batch.

Run: `python -m bench.packed_vs_padded` (options: `--help`). Prints a markdown table of training tokens/s
(forward + backward, real tokens only) for one mixed-length batch on a random Qwen2: the packer's padding-free
micro-batches through `packed_token_logprobs`; padded micro-batches in arrival order (Hugging Face 2-D
`attention_mask`, the trainer's own LM-head code, pads masked out); and padded after sorting by length (the
strongest padded baseline). Each repeat runs the three back to back; medians over repeats; the summed logprob
must agree (rtol 1e-3). Packed attention costs O(sum_i L_i^2) against O(rows * L_max^2) padded; the last column
estimates the share of forward FLOPs in attention scores. Results: bench/README.md, "Packed vs padded
training throughput".
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from packer.packing import plan_step_micro_batches
from trainer.forward.logprobs import linear_logprobs_and_entropy
from trainer.forward.packed import packed_token_logprobs


def mixed_lengths(num_samples: int, rng: np.random.Generator, low: int = 16, high: int = 1024) -> list[int]:
    """`[num_samples]` long-tailed sample lengths: exp(N(log 128, 1)) rounded, clipped to [low, high]."""
    x = np.exp(rng.normal(np.log(128), 1.0, num_samples))
    return np.clip(np.round(x), low, high).astype(int).tolist()


def padded_micro_batches(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Greedy padded micro-batches: take samples in `order` while `rows * longest <= budget` padded tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        if current and (len(current) + 1) * max(longest, lengths[i]) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def build_model(hidden: int, layers: int, vocab: int, max_len: int, seed: int) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM with random weights: head dim 64, 2 KV heads (GQA), MLP 4x hidden, sdpa."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).train()


def packed_step(model, samples: list[torch.Tensor], plan: list[list[int]]) -> float:
    """Forward + backward of every packed micro-batch; returns the summed logprob (a check value)."""
    total = 0.0
    for micro_batch in plan:
        ids = torch.cat([samples[i] for i in micro_batch])
        seq_lens = torch.tensor([len(samples[i]) for i in micro_batch])
        logprobs = packed_token_logprobs(model, ids, seq_lens)
        loss = -logprobs.sum()
        loss.backward()
        total += float(logprobs.detach().sum())
    return total


def padded_step(model, samples: list[torch.Tensor], batches: list[list[int]], pad_id: int = 0) -> float:
    """Forward + backward of every right-padded micro-batch; returns the summed logprob of real tokens."""
    head = model.get_output_embeddings()
    total = 0.0
    for micro_batch in batches:
        longest = max(len(samples[i]) for i in micro_batch)
        ids = torch.full((len(micro_batch), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(micro_batch), longest), dtype=torch.long)
        for row, i in enumerate(micro_batch):
            ids[row, : len(samples[i])] = samples[i]
            attention_mask[row, : len(samples[i])] = 1
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logprobs, _entropy = linear_logprobs_and_entropy(
            hidden[:, :-1].reshape(-1, hidden.shape[-1]), head.weight, head.bias, ids[:, 1:].reshape(-1)
        )
        logprobs = logprobs * attention_mask[:, 1:].reshape(-1)  # pad positions (and their gradient) get 0
        loss = -logprobs.sum()
        loss.backward()
        total += float(logprobs.detach().sum())
    return total


def timed(fn, *args) -> tuple[float, float]:
    """(seconds, return value) of one call."""
    started = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - started, value


def attention_share(
    lengths: list[int], packed_rows: list[list[int]], padded_rows: list[list[int]], hidden: int, layers: int, vocab: int
) -> tuple[float, float]:
    """Estimated share of forward FLOPs spent in attention scores (QK^T and AV: 4 * T_q * T_k * hidden per layer),
    against the dense matmuls (per token: 2 * (4 hidden^2 + 3 hidden * 4 hidden) per layer + 2 * hidden * vocab),
    for the packed rows (varlen attention: T_q = T_k = each sample's length) and the padded rows (rows * longest^2)."""
    per_token = layers * 2 * (4 * hidden * hidden + 12 * hidden * hidden) + 2 * hidden * vocab

    def share(attn: float, tokens: int) -> float:
        return attn / (attn + tokens * per_token)

    packed_attn = sum(4 * lengths[i] ** 2 * hidden * layers for row in packed_rows for i in row)
    padded_attn = sum(4 * len(row) * max(lengths[i] for i in row) ** 2 * hidden * layers for row in padded_rows)
    padded_tokens = sum(len(row) * max(lengths[i] for i in row) for row in padded_rows)
    return share(packed_attn, sum(lengths)), share(padded_attn, padded_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096], help="tokens per micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(args.seed)
    lengths = mixed_lengths(args.num_samples, rng)
    samples = [torch.from_numpy(rng.integers(1, args.vocab, n)).long() for n in lengths]
    model = build_model(args.hidden, args.layers, args.vocab, max(args.budgets), args.seed)
    total = sum(lengths)
    print(
        f"batch: {len(lengths)} samples, {total} tokens, lengths min/median/max {min(lengths)}/"
        f"{int(np.median(lengths))}/{max(lengths)}; model: Qwen2 hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; torch threads "
        f"{args.threads}, "
        f"{args.repeats} repeats"
    )
    header = (
        "| budget | variant | micro-batches | padded tokens | pad share | tokens/s (median) | packed speed-up over "
        "this (median) "
        "| est. attention share of FLOPs |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    arrival = list(range(len(lengths)))
    by_length = sorted(arrival, key=lambda i: (-lengths[i], i))
    for budget in args.budgets:
        plan = plan_step_micro_batches(lengths, budget)[0]
        variants = {
            "packed": plan,
            "padded (arrival order)": padded_micro_batches(lengths, arrival, budget),
            "padded (sorted by length)": padded_micro_batches(lengths, by_length, budget),
        }
        steps = {"packed": packed_step}
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        checks: dict[str, float] = {}
        for repeat in range(args.repeats + 1):  # repeat 0 warms up (allocator, kernels), not timed
            for name, rows in variants.items():
                step = steps.get(name, padded_step)
                elapsed, checks[name] = timed(step, model, samples, rows)
                model.zero_grad(set_to_none=True)
                if repeat:
                    seconds[name].append(elapsed)
        reference = checks["packed"]
        for name, value in checks.items():
            assert abs(value - reference) <= 1e-3 * abs(reference), f"{name} logprob sum {value} != packed {reference}"
        for name, rows in variants.items():
            packed_rows = name in steps
            padded_tokens = total if packed_rows else sum(len(r) * max(lengths[i] for i in r) for r in rows)
            ratios = [p / s for p, s in zip(seconds[name], seconds["packed"])]
            attn_packed, attn_padded = attention_share(lengths, plan, rows, args.hidden, args.layers, args.vocab)
            lines.append(
                f"| {budget} | {name} | {len(rows)} | {padded_tokens} | {1 - total / padded_tokens:.1%} "
                f"| {total / statistics.median(seconds[name]):,.0f} | {statistics.median(ratios):.2f}x "
                f"| {attn_packed if packed_rows else attn_padded:.1%} |"
            )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
