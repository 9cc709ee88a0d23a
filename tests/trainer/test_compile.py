"""``trainer.compile``: decoder layers compiled with torch.compile train as the eager ones do.

Real TorchDynamo tracing and AOTAutograd (the ``aot_eager`` backend: forward and backward graphs
traced, run without generated code, so the test takes seconds, not Inductor's minutes on this
CPU) on a real tiny Qwen2 policy through `Trainer.step`: same loss, metrics and updated weights as
the eager trainer, shared prefixes on and off, LoRA too; and one compile serves micro-batches of
every length (dynamic shapes: no new graph when the packed length or the number of samples changes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from configs.schema import LoraSection, OptimConfig, TrainerConfig
from tests.trainer.test_host_sync import grpo_samples, step_batches
from trainer.forward.compiled import compile_decoder_layers
from trainer.state.model import load_policy
from trainer.trainer import Trainer


def trained(model_dir: str, *, lora: bool, share: bool, compile: bool, steps: list) -> tuple[list[dict], dict]:
    torch.manual_seed(1)
    model = load_policy(model_dir, LoraSection(enabled=lora, rank=4, alpha=8.0))
    cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-3, max_grad_norm=1e9),
        share_prefixes=share,
        compile=compile,
        compile_backend="aot_eager",
    )
    trainer = Trainer(model, cfg, max_tokens=16)
    metrics = [trainer.step(mbs) for mbs in steps]
    return metrics, {k: v.grad.clone() for k, v in model.named_parameters() if v.requires_grad}  # the last step's


@pytest.mark.parametrize(("lora", "share"), [(False, True), (False, False), (True, True)])
def test_compiled_layers_train_like_eager_ones(model_dir, lora, share):
    torch._dynamo.reset()
    vocab = load_policy(model_dir, LoraSection(enabled=False)).config.vocab_size
    steps = [
        step_batches(grpo_samples(vocab, teacher=False, seed=seed), parts) for seed, parts in ((0, 1), (1, 2), (2, 3))
    ]
    eager_metrics, eager_grads = trained(model_dir, lora=lora, share=share, compile=False, steps=steps)
    counters.clear()
    compiled_metrics, compiled_grads = trained(model_dir, lora=lora, share=share, compile=True, steps=steps)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    for eager, compiled in zip(eager_metrics, compiled_metrics):
        for key in ("loss", "grad_norm", "kl", "entropy", "onpolicy_lp_diff_max"):
            np.testing.assert_allclose(compiled[key], eager[key], rtol=1e-4, atol=1e-6, err_msg=key)
    # gradients, not AdamW-updated weights: a key bias's gradient is rounding noise (softmax ignores
    # a constant added to every key score), which AdamW's normalisation turns into lr-sized steps
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("share", [False, True])
def test_one_compile_serves_every_packed_length_and_sample_count(model_dir, share):
    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: the graphs of an earlier test would count
    model = load_policy(model_dir, LoraSection(enabled=False))
    trainer = Trainer(
        model, TrainerConfig(compile=True, compile_backend="aot_eager", share_prefixes=share), max_tokens=16
    )
    vocab = model.config.vocab_size
    trainer.step(step_batches(grpo_samples(vocab, teacher=False, seed=0), 1))
    # more lengths (dynamic from here on), and single-sample micro-batches: no prefix to share, so with
    # share_prefixes the lengths path too (one more graph pair, once)
    trainer.step(step_batches(grpo_samples(vocab, teacher=False, seed=1), 8))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "nothing was compiled"
    lengths, counts = set(), set()
    for seed, parts in ((2, 2), (3, 3), (4, 5), (5, 8)):  # 4, 2-3, 1-2 and 1 samples per micro-batch
        mbs = step_batches(grpo_samples(vocab, teacher=False, seed=seed), parts)
        lengths.update(len(mb.input_ids) for mb in mbs)
        counts.update(len(mb.sample_ids) for mb in mbs)
        trainer.step(mbs)
    assert len(lengths) >= 4 and len(counts) >= 4
    # the sample lengths reach the attention as an opaque SeqLens: a list would be guarded on its
    # length, one recompile per sample count (what made trainer.compile gain nothing on GRPO batches)
    assert counters["stats"]["unique_graphs"] == graphs, "a new packed length or sample count recompiled the layers"


def test_a_model_without_decoder_layers_is_refused(model_dir):
    model = load_policy(model_dir, LoraSection(enabled=False))
    model.get_decoder().layers = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="no decoder layers to compile"):
        compile_decoder_layers(model)
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        compile_decoder_layers(model, "tensorrt")
