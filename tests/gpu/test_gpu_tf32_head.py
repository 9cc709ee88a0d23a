"""On a real GPU, ``trainer.lm_head_dtype: tf32`` turns CUDA TF32 matmuls on inside the LM head only.

A bfloat16 trainer step on CUDA (`Trainer.micro_step`, forward and backward) with a spy around the
head's logits matmul (`trainer.forward.logprobs.chunk_logits`) and hooks on the decoder layers
(their forward, and their output's gradient in the backward): inside the head the TF32 switch is on
and a float32 probe matmul really runs in TF32 (its error against float64 is TF32's ~5e-4 relative,
not float32's ~1e-7); in the layers and after the step it is off. With ``lm_head_dtype: float32`` it
is off everywhere (the control). The CPU check of the switch itself: tests/trainer/test_precision.py.
"""

from __future__ import annotations

import pytest
import torch

from configs.schema import OptimConfig, TrainerConfig
from tests.gpu.test_gpu_trainer_bf16 import micro_batch, tiny_model
from trainer.trainer import Trainer

TF32_REL_ERROR = 5e-5
"""Max error of a 256x256 @ 256x256 float32 probe matmul over the max of the float64 result, above
which it ran in TF32 (10-bit mantissa inputs: ~5e-4; float32: ~1e-7)."""


def tf32_in_effect() -> tuple[bool, bool]:
    """(the TF32 switch, whether a float32 probe matmul on CUDA runs in TF32 now), autocast off."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 256, device="cuda", generator=gen)
    b = torch.randn(256, 256, device="cuda", generator=gen)
    with torch.autocast("cuda", enabled=False):
        exact = a.double() @ b.double()
        error = ((a @ b).double() - exact).abs().max() / exact.abs().max()
    return torch.backends.cuda.matmul.allow_tf32, error.item() > TF32_REL_ERROR


@pytest.mark.parametrize(("head_dtype", "in_head"), [("tf32", (True, True)), ("float32", (False, False))])
def test_tf32_is_on_inside_the_lm_head_and_off_outside(monkeypatch, head_dtype, in_head):
    import trainer.forward.logprobs as head

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        assert tf32_in_effect() == (False, False), "the probe sees TF32 with the switch off"
        seen: dict[str, list[tuple[bool, bool]]] = {"head": [], "layers forward": [], "layers backward": []}
        real_logits = head.chunk_logits

        def logits_spy(hidden, weight, bias):
            seen["head"].append(tf32_in_effect())
            return real_logits(hidden, weight, bias)

        def layer_hook(_module, _args, output):
            seen["layers forward"].append(tf32_in_effect())
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(lambda grad: seen["layers backward"].append(tf32_in_effect()))

        monkeypatch.setattr(head, "chunk_logits", logits_spy)
        model = tiny_model()
        for layer in model.model.layers:
            layer.register_forward_hook(layer_hook)
        cfg = TrainerConfig(
            device="cuda", dtype="bfloat16", lm_head_dtype=head_dtype, optim=OptimConfig(lr=1e-3, max_grad_norm=1.0)
        )
        trainer = Trainer(model, cfg)
        for key in seen:
            seen[key].clear()  # only the step's own calls
        trainer.micro_step(micro_batch())
        torch.cuda.synchronize()
        assert len(seen["head"]) >= 2, "the head's matmul ran in neither the forward nor the backward"
        assert seen["layers forward"] and seen["layers backward"], seen
        assert set(seen["head"]) == {in_head}, seen["head"]
        assert set(seen["layers forward"]) == set(seen["layers backward"]) == {(False, False)}, seen
        assert tf32_in_effect() == (False, False), "TF32 left on after the step"
    finally:
        matmul.allow_tf32 = before
