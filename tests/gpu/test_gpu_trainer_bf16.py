"""Trainer micro_step on CUDA in bfloat16 (trainer.dtype=bfloat16, trainer.device=cuda) against
the same step in float32 on CUDA.

Same random Qwen2 (4 heads of 64, 2 kv heads, 2 layers), same packed micro-batch (4 samples of
mixed lengths, advantages of both signs). bfloat16 autocast rounds every matmul input to 8
mantissa bits (relative error ~2^-9 per element), so the loss (a mean of ratio * advantage terms)
is expected within 2% (+1e-3 absolute) of float32, and the whole gradient, as one vector, at cosine
similarity > 0.99 with the float32 one. It must also NOT be bitwise equal to float32 (else
trainer.dtype was ignored). Master weights, their gradients and AdamW's moments stay float32.
"""

from __future__ import annotations

import numpy as np
import torch

from configs.schema import OptimConfig, TrainerConfig
from tests.scored_groups import packed_step, scored
from trainer.trainer import Trainer

SAMPLES = [
    ([1, 2, 3], [40, 41, 42, 43, 44], 1.0),
    ([4, 5], [60, 61, 62], -1.0),
    ([6, 7, 8, 9], [70, 71, 72, 73, 74, 75, 76], 0.5),
    ([10], [80, 81], -0.5),
]


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).cuda().train()


def micro_batch():
    rng = np.random.default_rng(0)
    groups = []
    for k, (prompt, completion, advantage) in enumerate(SAMPLES):
        lp = -rng.uniform(4.0, 7.0, len(prompt) + len(completion))[len(prompt) :]  # ~log(1/300)
        groups.append(scored(f"g{k}", prompt, [completion], advantages=[advantage], rewards=[1.0], logprobs=[lp]))
    (mb,) = packed_step(groups)
    return mb


def run(dtype: str):
    model = tiny_model()
    cfg = TrainerConfig(device="cuda", dtype=dtype, optim=OptimConfig(lr=1e-3, max_grad_norm=1.0))
    trainer = Trainer(model, cfg)
    loss, _stats = trainer.micro_step(micro_batch())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return trainer, loss, grads


def test_bf16_micro_step_matches_float32_reference():
    _, loss_ref, grads_ref = run("float32")
    trainer, loss, grads = run("bfloat16")
    assert np.isfinite(loss)
    assert abs(loss - loss_ref) <= 0.02 * abs(loss_ref) + 1e-3, (loss, loss_ref)
    assert loss != loss_ref, "bfloat16 loss bitwise equal to float32: trainer.dtype not applied"
    cos = torch.nn.functional.cosine_similarity(grads.float(), grads_ref.float(), dim=0).item()
    assert cos > 0.99, f"bf16 gradient cosine similarity {cos:.4f} with float32"
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    trainer.optimizer.step()
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
