"""GRPO on reverse_text through ``busctl serve``, driven only through the official Tinker SDK: each step samples
a group of completions per prompt from the client's current weights (``save_weights_and_get_sampling_client``),
scores them with reverse_text's reward, and trains with ``importance_sampling`` on group-centred advantages; the
eval reward (greedy, held-out prompts) is printed before and after. Its learning run is in bench/README.md.

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


def evaluate(sampler, tokenizer, examples, max_tokens: int) -> float:
    """Mean reward of greedy completions of ``examples``."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [
        sampler.sample(types.ModelInput.from_ints(prompt_ids(tokenizer, ex["prompt"])), 1, params) for ex in examples
    ]
    rewards = [
        reverse_text_reward(tokenizer.decode(f.result().sequences[0].tokens), ex["info"])
        for ex, f in zip(examples, futures)
    ]
    return float(np.mean(rewards))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="the base model (default: the server's first)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eval", type=int, default=32, help="held-out prompts evaluated")
    args = parser.parse_args()
    client = tinker.ServiceClient()  # TINKER_BASE_URL, TINKER_API_KEY
    model = args.model or tinker.RestClient().get_server_capabilities().result().supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    tokenizer = tc.get_tokenizer()
    train = reverse_text_examples("train", args.steps * args.prompts, seed=0)
    held_out = reverse_text_examples("eval", args.eval, seed=0)
    sampler = tc.save_weights_and_get_sampling_client().result()
    first = evaluate(sampler, tokenizer, held_out, args.max_tokens)
    print(f"eval reward before: {first:.3f}")
    started = time.monotonic()
    for step in range(args.steps):
        batch = train[step * args.prompts : (step + 1) * args.prompts]
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        prompts = [prompt_ids(tokenizer, ex["prompt"]) for ex in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        data, rewards_all = [], []
        for ex, p, fut in zip(batch, prompts, futures):
            seqs = fut.result().sequences
            rewards = np.array([reverse_text_reward(tokenizer.decode(s.tokens), ex["info"]) for s in seqs])
            rewards_all += rewards.tolist()
            for s, adv in zip(seqs, rewards - rewards.mean()):
                tokens = p + list(s.tokens)
                n_prompt = len(p) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(tokens[1:], dtype=np.int64),
                            "logprobs": np.array([0.0] * n_prompt + list(s.logprobs), dtype=np.float32),
                            "advantages": np.array([0.0] * n_prompt + [adv] * len(s.tokens), dtype=np.float32),
                        },
                    )
                )
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        print(f"step {step}: reward {np.mean(rewards_all):.3f} ({time.monotonic() - started:.0f} s)")
    last = evaluate(sampler, tokenizer, held_out, args.max_tokens)
    print(f"eval reward before: {first:.3f} after: {last:.3f} (+{last - first:.3f})")


if __name__ == "__main__":
    main()
