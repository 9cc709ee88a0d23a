"""Held-out evaluation in the trainer: mean reward of sampled completions on fixed eval prompts.

``eval_reward_mean`` is the mean reward of ``num_samples`` completion(s) per prompt, sampled at the
run's temperature from the trainer's current weights with transformers ``generate``, on the
task's eval split (disjoint from the training prompts). It is computed at step 0 and after the
last step, so the two numbers compare the same prompts under the same sampling.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase


@torch.no_grad()
def eval_reward_mean(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    messages_fn: Callable[[dict[str, Any]], list[dict[str, str]]],
    reward_fn: Callable[[str, dict], float],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    num_samples: int = 1,
    batch_size: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """Sample completions for every eval example and score them.

    Args:
        model: the policy (HF causal LM, possibly peft-wrapped); left in its prior train/eval mode.
        examples: eval examples ``{"id", "prompt", "info"}``; messages_fn renders one to chat messages.
        reward_fn: ``(completion, info) -> reward``.
        max_tokens: most new tokens per completion. temperature, top_p: sampling parameters.
        num_samples: completions per prompt. batch_size: prompts per ``generate`` call.
        seed: RNG seed; the caller's RNG state is restored afterwards.

    Returns:
        ``{"eval_reward_mean": float, "eval_num_samples": float, "eval_completion_len_mean": float}``.

    Raises:
        ValueError: no examples.
    """
    if not examples:
        raise ValueError("eval needs at least one example")
    was_training = model.training
    model.eval()
    rewards: list[float] = []
    lengths: list[int] = []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            texts = [tokenizer.apply_chat_template(messages_fn(ex), tokenize=False, add_generation_prompt=True) for ex in batch]
            tokenizer.padding_side = "left"
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_new_tokens=max_tokens,
                num_return_sequences=num_samples,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
            completions = out[:, enc["input_ids"].shape[1] :]
            for k, row in enumerate(completions):
                ex = batch[k // num_samples]
                ids = row.tolist()
                if eos in ids:
                    ids = ids[: ids.index(eos) + 1]
                lengths.append(len(ids))
                rewards.append(float(reward_fn(tokenizer.decode(ids, skip_special_tokens=True), ex["info"])))
    model.train(was_training)
    return {
        "eval_reward_mean": sum(rewards) / len(rewards),
        "eval_num_samples": float(len(rewards)),
        "eval_completion_len_mean": sum(lengths) / len(lengths),
    }
