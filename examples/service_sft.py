"""Supervised fine-tuning through ``busctl serve`` with the official Tinker SDK: a LoRA client learns
reverse_text's answers (cross_entropy on the completion tokens only), step by step over HTTP.

    RLBUS_SERVE_API_KEYS=tml-mykey busctl serve model.path=PATH serve.port=8000 serve.samplers=0
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-mykey python examples/service_sft.py --model PATH
"""

from __future__ import annotations

import argparse

import numpy as np
import tinker
from tinker import types

from tasks.reverse_text import reverse_text_examples


def sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """One chat-formatted example: weights 1 on the answer's tokens (and its end of turn), 0 on the prompt's."""
    messages = [{"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt_ids + answer_ids
    weights = np.array([0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids), dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": weights},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the base model busctl serve serves (its model.path)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    client = tinker.ServiceClient()  # TINKER_BASE_URL, TINKER_API_KEY
    tc = client.create_lora_training_client(base_model=args.model, rank=16, seed=0).result()
    tokenizer = tc.get_tokenizer()
    data = reverse_text_examples("train", args.steps * args.batch, seed=0)
    for step in range(args.steps):
        batch = [sft_datum(tokenizer, ex["prompt"], ex["info"]["target"]) for ex in data[step :: args.steps]]
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        out = fb.result()
        opt.result()
        tokens = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in batch)
        print(f"step {step}: loss per answer token {out.metrics['loss:sum'] / tokens:.3f}")
    print("saved:", tc.save_state("sft-final").result().path)


if __name__ == "__main__":
    main()
