"""GRPO on reverse_text through ``busctl serve``, driven only through the official Tinker SDK: each step samples
a group of completions per prompt from the client's current weights (``save_weights_and_get_sampling_client``),
scores them with reverse_text's reward, and trains with ``importance_sampling`` (a sum over tokens) on GRPO
advantages scaled by 1 / the step's completion tokens, so that the step is the default job's (token mean, 16
prompts x 8, AdamW betas (0.9, 0.999), grad clip 1). The eval is the default job's too: mean reward of one
temperature-1 completion for each of 128 held-out prompts (greedy printed beside it), before and after.
Its learning run is in bench/README.md.

    RLBUS_SERVE_API_KEYS=tml-mykey busctl serve serve.port=8000    # model.path unset: the tiny reverse_text policy
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-mykey python examples/service_grpo.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tinker
from tinker import types

from tasks.reverse_text import reverse_text_examples, reverse_text_reward


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def evaluate(sampler, tokenizer, examples, max_tokens: int, temperature: float) -> float:
    """Mean reward of one completion per example at ``temperature`` (0: greedy)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    futures = [
        sampler.sample(types.ModelInput.from_ints(prompt_ids(tokenizer, ex["prompt"])), 1, params) for ex in examples
    ]
    rewards = [
        reverse_text_reward(tokenizer.decode(f.result().sequences[0].tokens), ex["info"])
        for ex, f in zip(examples, futures)
    ]
    return float(np.mean(rewards))


def evaluate_both(sampler, tokenizer, examples, max_tokens: int) -> tuple[float, float]:
    """(temperature-1 eval, greedy eval) over ``examples``."""
    return evaluate(sampler, tokenizer, examples, max_tokens, 1.0), evaluate(
        sampler, tokenizer, examples, max_tokens, 0.0
    )


def grpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """``(r - mean) / (std + 1e-6)`` over one group (rlbus's default ``grpo``, DeepSeekMath Sec. 4.1.2)."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="the base model (default: the server's first)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--train-unembed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train the LM head beside the adapter (the SDK's default; it matters on the tiny policy)",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eval", type=int, default=128, help="held-out prompts evaluated")
    args = parser.parse_args()
    client = tinker.ServiceClient()  # TINKER_BASE_URL, TINKER_API_KEY
    model = args.model or tinker.RestClient().get_server_capabilities().result().supported_models[0].model_name
    tc = client.create_lora_training_client(
        base_model=model, rank=args.rank, seed=0, train_unembed=args.train_unembed
    ).result()
    tokenizer = tc.get_tokenizer()
    train = reverse_text_examples("train", args.steps * args.prompts, seed=0)
    held_out = reverse_text_examples("eval", args.eval, seed=0)
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
    sampler = tc.save_weights_and_get_sampling_client().result()
    first = evaluate_both(sampler, tokenizer, held_out, args.max_tokens)
    print(f"eval reward before: {first[0]:.3f} (greedy {first[1]:.3f})", flush=True)
    started = time.monotonic()
    for step in range(args.steps):
        batch = train[step * args.prompts : (step + 1) * args.prompts]
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        prompts = [prompt_ids(tokenizer, ex["prompt"]) for ex in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        groups, rewards_all = [], []
        for ex, p, fut in zip(batch, prompts, futures):
            seqs = fut.result().sequences
            rewards = np.array([reverse_text_reward(tokenizer.decode(s.tokens), ex["info"]) for s in seqs])
            rewards_all += rewards.tolist()
            groups.append((p, seqs, grpo_advantages(rewards)))
        per_token = 1.0 / sum(len(s.tokens) for _, seqs, _ in groups for s in seqs)  # the loss sum -> a token mean
        data = []
        for p, seqs, advantages in groups:
            for s, adv in zip(seqs, advantages):
                tokens = p + list(s.tokens)
                n_prompt = len(p) - 1  # target i is tokens[i + 1]: the completion's targets start here
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(tokens[1:], dtype=np.int64),
                            "logprobs": np.array([0.0] * n_prompt + list(s.logprobs), dtype=np.float32),
                            "advantages": np.array(
                                [0.0] * n_prompt + [adv * per_token] * len(s.tokens), dtype=np.float32
                            ),
                        },
                    )
                )
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(adam).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        print(f"step {step}: reward {np.mean(rewards_all):.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    last = evaluate_both(sampler, tokenizer, held_out, args.max_tokens)
    print(
        f"eval reward before: {first[0]:.3f} after: {last[0]:.3f} ({last[0] - first[0]:+.3f}); "
        f"greedy {first[1]:.3f} -> {last[1]:.3f} ({last[1] - first[1]:+.3f}); "
        f"{args.steps} steps in {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
