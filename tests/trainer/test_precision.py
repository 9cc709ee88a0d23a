"""Tests for the trainer's precision policy (``trainer.dtype``, :mod:`trainer.forward.precision`) on CPU.

bfloat16 is mixed precision: the forwards run under CPU autocast to bfloat16, while parameters,
gradients, AdamW moments, logprobs and the loss stay float32. The bfloat16 results are compared
with the float32 reference on the tiny random Qwen2 of ``conftest.py``.

Tolerances, and why: autocast rounds every matmul input to bfloat16 (8-bit mantissa, relative
rounding error 2^-9 ~ 0.2%), so a logprob of a 2-layer model differs from float32 by ~1e-3 nats
(measured: max 1.8e-3 over these samples, entropy 1e-5); we allow 0.03 nats per token, the
bfloat16 error of one logit of size ~5-10 (a deeper or wider model accumulates more; the LM head
itself runs in float32). The loss is a mean of such logprobs times advantages of size <= 1:
measured relative difference 3.3e-3, allowed 2%.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from configs.schema import LossConfig, OptimConfig, TrainerConfig
from tests.trainer.test_trainer import micro_batches, policy, samples
from trainer.forward.logprobs import HEAD_DTYPES, head_matmul_precision
from trainer.forward.packed import packed_logprobs_and_entropy
from trainer.forward.precision import PrecisionPolicy
from trainer.trainer import Trainer

LOGPROB_ATOL = 0.03
"""Nats per token between a bfloat16-autocast and a float32 forward (see the module docstring)."""
LOSS_RTOL = 0.02


@pytest.fixture
def tf32_off():
    """CUDA TF32 matmuls off for the test, the setting restored after it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield matmul
    matmul.allow_tf32 = before


def cfg(dtype: str, **loss) -> TrainerConfig:
    return TrainerConfig(dtype=dtype, optim=OptimConfig(lr=1e-3, max_grad_norm=1e9), loss=LossConfig(**loss))


def test_policy_names_and_errors():
    assert PrecisionPolicy.from_name("float32").compute_dtype == torch.float32
    assert PrecisionPolicy.from_name("bfloat16").mixed
    with pytest.raises(ValueError, match="trainer.dtype"):
        PrecisionPolicy.from_name("float16")
    with pytest.raises(ValueError, match="compute_dtype"):
        PrecisionPolicy(torch.float16)
    with PrecisionPolicy.from_name("float32").autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with PrecisionPolicy.from_name("bfloat16").autocast(torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_logprobs_are_float32_and_close_to_float32(model_dir, lora):
    model = policy(model_dir, lora)
    ids = torch.tensor([1, 2, 3, 40, 41, 42, 43, 4, 5, 60, 61, 62, 99, 7])
    lens = torch.tensor([7, 5, 2])
    ref_lp, ref_ent = packed_logprobs_and_entropy(model, ids, lens)
    with PrecisionPolicy.from_name("bfloat16").autocast("cpu"):
        lp, ent = packed_logprobs_and_entropy(model, ids, lens)
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.requires_grad
    assert (lp - ref_lp).abs().max().item() < LOGPROB_ATOL
    assert (ent - ref_ent).abs().max().item() < LOGPROB_ATOL
    # the bfloat16 compute is real: the body's results differ from float32 (not a silent no-op)
    assert not torch.equal(lp, ref_lp)
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_step_keeps_float32_state_and_tracks_float32(model_dir, lora):
    """One step each way from the same weights: the bfloat16 step's loss and metrics are close to
    float32's, the parameters, their gradients and AdamW's moments are float32, and the update
    points the same way (cosine > 0.99 over all trainable weights)."""
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = policy(model_dir, lora)
        ss = samples(model)  # float32 sampler logprobs: bf16's ratio is then ~1, not exactly 1
        trainer = Trainer(model, cfg(dtype))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        grads = {}
        hooks = [
            p.register_hook(lambda g, n=n, grads=grads: grads.__setitem__(n, g.dtype))
            for n, p in model.named_parameters()
            if p.requires_grad
        ]
        metrics = trainer.step(micro_batches(ss, [[0, 1], [2, 3]]))
        for h in hooks:
            h.remove()
        assert set(grads.values()) == {torch.float32}, dtype
        assert all(p.dtype == torch.float32 for p in model.parameters())
        states = list(trainer.optimizer.state.values())
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
        update = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters() if p.requires_grad])
        results[dtype] = (metrics, update)
    (m32, u32), (m16, u16) = results["float32"], results["bfloat16"]
    assert np.isfinite(m16["loss"]) and m16["skipped"] == 0.0
    assert m16["loss"] == pytest.approx(m32["loss"], rel=LOSS_RTOL)
    assert m16["onpolicy_lp_diff_max"] < LOGPROB_ATOL  # bf16 policy vs the float32 sampler logprobs
    assert m16["importance_ratio_mean"] == pytest.approx(1.0, abs=LOGPROB_ATOL)
    cosine = torch.nn.functional.cosine_similarity(u32, u16, dim=0).item()
    assert cosine > 0.99


def test_reference_runs_in_the_policys_compute_dtype(model_dir):
    """With the KL penalty against the frozen reference, step 0 has KL exactly 0 under bfloat16:
    the reference's forward runs under the same autocast as the policy's (a float32 reference
    would differ by the bfloat16 rounding, ~1e-3 nats)."""
    model = policy(model_dir, lora=False)
    ss = samples(model)
    trainer = Trainer(model, cfg("bfloat16", kl_tau=0.1, kl_reference="reference", kl_estimator="k3"))
    assert trainer.reference is not None
    ref_params = list(trainer.reference.model.parameters())
    assert all(p.dtype == torch.float32 for p in ref_params)
    frozen = copy.deepcopy([p.detach() for p in ref_params])
    metrics = trainer.step(micro_batches(ss, [[0, 1, 2, 3]]))
    assert metrics["kl_penalty"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(frozen, trainer.reference.model.parameters()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_of_bfloat16_weights_are_float32(temperature):
    """Where the head's weight itself is bfloat16 (FSDP2 with ``param_dtype=bfloat16`` casts the
    parameters for the forward), the chunked path still returns float32 logprobs and entropy: the
    logits are upcast before the log-softmax, equal to the naive ``log_softmax(linear(h, W).float()
    / T)`` up to float32 rounding (1e-5), and the gradients come back in the inputs' dtype."""
    from trainer.forward.logprobs import linear_logprobs_and_entropy

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(50, 16, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    lp, ent = linear_logprobs_and_entropy(hidden, weight, None, targets, temperature=temperature, chunk_size=8)
    assert lp.dtype == ent.dtype == torch.float32
    logits = torch.nn.functional.linear(hidden.detach(), weight.detach()).float() / temperature
    naive = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    assert (lp.detach() - naive).abs().max().item() < 1e-5
    lp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "head_dtype, matmul_dtype",
    [
        ("float32", torch.float32),
        ("tf32", torch.float32),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_dtypes_that_reach_attention_and_the_lm_head(model_dir, monkeypatch, tf32_off, head_dtype, matmul_dtype):
    """A Trainer step under trainer.dtype=bfloat16 on CPU: every packed-attention call gets q/k/v in
    bfloat16 (cast from the float32 RoPE output, as on CUDA before the varlen kernel), and the LM
    head's matmuls run in trainer.lm_head_dtype's dtype, forward and backward; logprobs, loss and
    every gradient stay float32. tf32 is a CUDA matmul mode: on CPU the head runs plain float32 and
    the CUDA TF32 switch stays off (tests/gpu/test_gpu_tf32_head.py checks it on inside a CUDA head)."""
    import trainer.forward.logprobs as head
    import trainer.forward.packed_attention as attention

    attn_dtypes, head_dtypes, head_tf32 = [], [], []
    real_sdpa, real_logits = attention.F.scaled_dot_product_attention, head.chunk_logits

    def sdpa_spy(q, k, v, **kw):
        attn_dtypes.append((q.dtype, k.dtype, v.dtype))
        return real_sdpa(q, k, v, **kw)

    def logits_spy(hidden, weight, bias):
        head_dtypes.append((hidden.dtype, weight.dtype))
        head_tf32.append(torch.backends.cuda.matmul.allow_tf32)
        return real_logits(hidden, weight, bias)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa_spy)
    monkeypatch.setattr(head, "chunk_logits", logits_spy)
    model = policy(model_dir, lora=False)
    ss = samples(model)
    attn_dtypes.clear()  # the sampler logprobs of samples() above ran unmixed
    head_dtypes.clear()
    trainer = Trainer(
        model,
        TrainerConfig(
            dtype="bfloat16",
            lm_head_dtype=head_dtype,
            share_prefixes=False,
            optim=OptimConfig(lr=1e-3, max_grad_norm=1e9),
        ),
    )
    metrics = trainer.step(micro_batches(ss, [list(range(len(ss)))]))
    assert np.isfinite(metrics["loss"])
    assert attn_dtypes and set(attn_dtypes) == {(torch.bfloat16,) * 3}
    assert head_dtypes and set(head_dtypes) == {(matmul_dtype, matmul_dtype)}
    assert set(head_tf32) == {False} and not tf32_off.allow_tf32  # no TF32 on CPU
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("head_dtype", HEAD_DTYPES)
def test_tf32_is_switched_on_only_for_a_tf32_head_on_cuda(tf32_off, head_dtype):
    """The switch the LM head's forward and backward run under (``head_matmul_precision``; it needs no
    GPU to flip): CUDA TF32 matmuls on inside it for "tf32" on a CUDA device, off again after it,
    also after an error; untouched for the other dtypes and on CPU; a TF32 setting made outside it
    is kept. The same inside a real CUDA step: tests/gpu/test_gpu_tf32_head.py."""
    for device in ("cuda", "cpu"):
        with head_matmul_precision(head_dtype, torch.device(device)):
            inside = tf32_off.allow_tf32
        assert inside == (head_dtype == "tf32" and device == "cuda"), device
        assert not tf32_off.allow_tf32, f"left on after the head ({device})"
    with pytest.raises(RuntimeError, match="in the head"), head_matmul_precision(head_dtype, torch.device("cuda")):
        raise RuntimeError("in the head")
    assert not tf32_off.allow_tf32, "left on after an error in the head"
    tf32_off.allow_tf32 = True
    with head_matmul_precision(head_dtype, torch.device("cuda")):
        assert tf32_off.allow_tf32
    assert tf32_off.allow_tf32


def test_bf16_lm_head_logprobs_close_to_float32(model_dir):
    """lm_head_dtype=bfloat16: float32 logprobs within bfloat16 rounding of the float32 head, and
    a float32 weight gradient close to the float32 head's."""
    model = policy(model_dir, lora=False)
    ids = torch.tensor([1, 2, 3, 40, 41, 42, 43, 4, 5, 60, 61, 62, 99, 7])
    lens = torch.tensor([7, 5, 2])
    grads = {}
    for head_dtype in ("float32", "bfloat16"):
        model.zero_grad()
        lp, _ = packed_logprobs_and_entropy(model, ids, lens, head_dtype=head_dtype)
        assert lp.dtype == torch.float32
        lp.sum().backward()
        grads[head_dtype] = (lp.detach(), model.get_output_embeddings().weight.grad.clone())
    (lp32, g32), (lp16, g16) = grads["float32"], grads["bfloat16"]
    assert (lp16 - lp32).abs().max().item() < LOGPROB_ATOL and not torch.equal(lp16, lp32)
    assert g16.dtype == torch.float32
    assert torch.allclose(g16, g32, atol=0.02 * g32.abs().max().item())
    with pytest.raises(ValueError, match="head_dtype must be one of"):
        packed_logprobs_and_entropy(model, ids, lens, head_dtype="float16")
