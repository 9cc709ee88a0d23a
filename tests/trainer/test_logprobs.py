"""Tests for trainer.forward.logprobs (chunked LM-head logprobs + entropy) and the Triton kernels under the interpreter.

Reference everywhere: the naive full-logits computation, written out here
    z = (h @ W.T + b).float() / temperature       [T, V]
    logprob[t] = log_softmax(z)[t, target[t]],   entropy[t] = -sum_v exp(log_softmax(z)) * log_softmax(z)
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.forward.logprobs import linear_logprobs_and_entropy

REPO_ROOT = Path(__file__).resolve().parents[2]


def _naive(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob, entropy.detach()


def _inputs(num_tokens, vocab, hidden_size=24, *, bias=False, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=generator) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator)
    grad_out = torch.randn(num_tokens, generator=generator)  # a random upstream gradient on the logprobs
    return hidden, weight, b, targets, grad_out


def _values_and_grads(fn, hidden, weight, bias, targets, grad_out, temperature):
    logprob, entropy = fn(hidden, weight, bias, targets, temperature)
    params = [p for p in (hidden, weight, bias) if p is not None]
    grads = torch.autograd.grad((logprob * grad_out).sum(), params)
    return logprob.detach(), entropy, grads


def _chunked(chunk_size, backend="torch"):
    def fn(hidden, weight, bias, targets, temperature):
        return linear_logprobs_and_entropy(
            hidden, weight, bias, targets, temperature=temperature, chunk_size=chunk_size, backend=backend
        )

    return fn


@pytest.mark.parametrize(
    "num_tokens, vocab, chunk_size, temperature, bias",
    [
        (37, 1000, 8, 1.0, False),  # T not a multiple of the chunk
        (5, 333, 16, 0.7, True),  # T < chunk, odd V, temperature != 1, bias
        (32, 257, 8, 1.3, False),  # T a multiple of the chunk
        (19, 4099, 1, 0.5, True),  # one row per chunk, V just above a power of two
    ],
)
def test_chunked_matches_naive(num_tokens, vocab, chunk_size, temperature, bias):
    inputs = _inputs(num_tokens, vocab, bias=bias)
    lp, ent, grads = _values_and_grads(_chunked(chunk_size), *inputs, temperature)
    ref_lp, ref_ent, ref_grads = _values_and_grads(_naive, *inputs, temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (num_tokens,)
    assert not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)
    assert (lp <= 0).all() and (ent >= 0).all() and (ent <= torch.log(torch.tensor(float(vocab))) + 1e-5).all()


def test_entropy_by_hand():
    """Two tokens, V=2 with W = identity: logits are the hidden states themselves."""
    hidden = torch.tensor([[0.0, 0.0], [torch.log(torch.tensor(3.0)).item(), 0.0]])
    lp, ent = linear_logprobs_and_entropy(hidden, torch.eye(2), None, torch.tensor([0, 1]), chunk_size=1)
    # uniform: logprob = log 1/2, entropy = log 2; p = (3/4, 1/4): logprob(1) = log 1/4,
    # entropy = -(3/4 log 3/4 + 1/4 log 1/4)
    expected_ent = -(0.75 * torch.log(torch.tensor(0.75)) + 0.25 * torch.log(torch.tensor(0.25)))
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.25])), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, torch.stack([torch.log(torch.tensor(2.0)), expected_ent]), rtol=0, atol=1e-6)


def test_frozen_weight_gets_no_gradient():
    """LoRA training freezes lm_head: no [V, H] gradient is computed, hidden still gets the right one."""
    hidden, weight, _, targets, grad_out = _inputs(20, 500)
    weight.requires_grad_(False)
    lp, _ = linear_logprobs_and_entropy(hidden, weight, None, targets, temperature=0.9, chunk_size=6)
    (lp * grad_out).sum().backward()
    ref_lp, _ = _naive(hidden, weight, None, targets, 0.9)
    (ref_grad,) = torch.autograd.grad((ref_lp * grad_out).sum(), [hidden])
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_empty_input():
    hidden, weight, _, targets, _ = _inputs(0, 50)
    lp, ent = linear_logprobs_and_entropy(hidden, weight, None, targets, chunk_size=4)
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    assert hidden.grad.shape == (0, 24) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_bfloat16_close_to_naive():
    """bf16 weights: logits in bf16, softmax in float32 (as the naive path); bf16 rounding bounds the match."""
    inputs = _inputs(24, 700, dtype=torch.bfloat16)
    lp, ent, grads = _values_and_grads(_chunked(5), *inputs, 0.8)
    ref_lp, ref_ent, ref_grads = _values_and_grads(_naive, *inputs, 0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # same bf16 logits, float32 after
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), ref.float(), rtol=2e-2, atol=2e-3)


def test_autocast_does_not_change_the_result():
    """Under CPU bf16 autocast the op still computes in its inputs' dtype (float32), forward and backward."""
    inputs = _inputs(15, 300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent, grads = _values_and_grads(_chunked(4), *inputs, 1.0)
    ref_lp, ref_ent, ref_grads = _values_and_grads(_naive, *inputs, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)


class _LargestOutput(TorchDispatchMode):
    """Records the element count of every tensor any aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def _largest_saved_and_allocated(fn, num_tokens, vocab, hidden_size):
    hidden, weight, bias, targets, grad_out = _inputs(num_tokens, vocab, hidden_size)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with _LargestOutput() as recorder:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprob, _ = fn(hidden, weight, bias, targets, 1.0)
        (logprob * grad_out).sum().backward()
    return max(saved), recorder.largest


def test_no_tensor_of_num_tokens_by_vocab():
    """Saved-for-backward tensors and every op output (fwd + bwd) stay O(chunk*V + V*H), never T*V."""
    num_tokens, vocab, hidden_size, chunk_size = 512, 4096, 16, 64
    full = num_tokens * vocab
    bound = max(chunk_size * vocab, vocab * hidden_size)
    saved, allocated = _largest_saved_and_allocated(_chunked(chunk_size), num_tokens, vocab, hidden_size)
    assert saved <= vocab * hidden_size, f"largest saved tensor has {saved} elements"
    assert allocated <= bound, f"an op produced {allocated} elements > chunk*V={chunk_size * vocab}"
    # the same measures see the [T, V] tensors of the naive path, so they can fail
    naive_saved, naive_allocated = _largest_saved_and_allocated(_naive, num_tokens, vocab, hidden_size)
    assert naive_saved >= full and naive_allocated >= full


def test_bad_inputs_raise():
    hidden, weight, bias, targets, _ = _inputs(6, 40, bias=True)
    with pytest.raises(ValueError, match="hidden must be a 2-D float tensor"):
        linear_logprobs_and_entropy(hidden[0], weight, bias, targets)
    with pytest.raises(ValueError, match="weight must be"):
        linear_logprobs_and_entropy(hidden, weight[:, :3], bias, targets)
    with pytest.raises(ValueError, match="share dtype and device"):
        linear_logprobs_and_entropy(hidden.double(), weight, bias, targets)
    with pytest.raises(ValueError, match="bias must be"):
        linear_logprobs_and_entropy(hidden, weight, bias[:5], targets)
    with pytest.raises(ValueError, match="targets must be an integer tensor"):
        linear_logprobs_and_entropy(hidden, weight, bias, targets[:3])
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 40\)"):
        linear_logprobs_and_entropy(hidden, weight, bias, targets + 40)
    with pytest.raises(ValueError, match="temperature must be"):
        linear_logprobs_and_entropy(hidden, weight, bias, targets, temperature=float("nan"))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        linear_logprobs_and_entropy(hidden, weight, bias, targets, chunk_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_logprobs_and_entropy(hidden, weight, bias, targets, backend="cuda")


TRITON_CHECK = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch
    try:
        import triton, triton.language as tl

        @triton.jit
        def _probe(x_ptr, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) + 1.0)

        probe = torch.zeros(4)
        _probe[(1,)](probe, BLOCK=4)
        assert probe.tolist() == [1.0] * 4
    except Exception as error:  # the interpreter itself cannot run on this install: skip, say why
        print(json.dumps({"skip": f"triton interpreter unusable here: {type(error).__name__}: {error}"}))
        sys.exit(0)
    from trainer.kernels import triton_logprobs
    from trainer.forward.logprobs import chunk_grad_logits, chunk_logprob_entropy, linear_logprobs_and_entropy
    triton_logprobs.MAX_BLOCK_V = 64  # several vocabulary tiles per row, the last one partial
    cases = json.loads(sys.argv[1])
    results = []
    for num_tokens, vocab, chunk, temperature, use_bias in cases:
        g = torch.Generator().manual_seed(vocab)
        hidden = torch.randn(num_tokens, 16, generator=g)
        weight = torch.randn(vocab, 16, generator=g) / 4
        bias = torch.randn(vocab, generator=g) * 0.1 if use_bias else None
        targets = torch.randint(0, vocab, (num_tokens,), generator=g)
        grad_out = torch.randn(num_tokens, generator=g)
        row = {}
        # the per-chunk ops against the torch backend
        logits = torch.nn.functional.linear(hidden, weight, bias)
        mine = triton_logprobs.chunk_logprob_entropy(logits, targets, temperature)
        ref = chunk_logprob_entropy(logits.clone(), targets, temperature)
        row["chunk_forward"] = max(float((a - b).abs().max()) for a, b in zip(mine, ref))
        grad_mine = triton_logprobs.chunk_grad_logits(logits.clone(), targets, ref[2], grad_out, temperature)
        grad_ref = chunk_grad_logits(logits.clone(), targets, ref[2], grad_out, temperature)
        row["chunk_grad"] = float((grad_mine - grad_ref).abs().max())
        # the whole chunked op with the triton backend against the naive full-logits computation
        leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if use_bias else ())]
        lp, ent = linear_logprobs_and_entropy(leaves[0], leaves[1], leaves[2] if use_bias else None, targets,
                                              temperature=temperature, chunk_size=chunk, backend="triton")
        grads = torch.autograd.grad((lp * grad_out).sum(), leaves)
        naive_leaves = [t.clone().requires_grad_() for t in leaves]
        z = torch.nn.functional.linear(naive_leaves[0], naive_leaves[1], naive_leaves[2] if use_bias else None)
        logp = torch.log_softmax(z.float() / temperature, dim=-1)
        ref_lp = logp.gather(1, targets[:, None]).squeeze(1)
        ref_ent = -(logp.exp() * logp).sum(-1).detach()
        ref_grads = torch.autograd.grad((ref_lp * grad_out).sum(), naive_leaves)
        lp, ref_lp = lp.detach(), ref_lp.detach()
        row["logprob"] = float((lp - ref_lp).abs().max())
        row["entropy"] = float((ent - ref_ent).abs().max())
        row["grads"] = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads))
        results.append(row)
    print(json.dumps({"results": results}))
    """
)


def test_triton_kernels_in_interpreter():
    """Triton kernels (TRITON_INTERPRET=1, CPU) == torch backend == naive, to 1e-5; in a fresh process."""
    pytest.importorskip("triton")
    cases = [[13, 200, 4, 1.0, False], [6, 77, 8, 0.7, True], [9, 130, 9, 1.4, False]]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK, json.dumps(cases)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    for case, row in zip(cases, report["results"], strict=True):
        for measure, error in row.items():
            assert error <= 1e-5, f"case {case}: {measure} differs by {error}"
