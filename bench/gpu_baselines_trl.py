"""The baselines of bench/gpu_trainer.py: TRL's GRPOTrainer step (and the plain HF step of the earlier
runs) on the same samples as rlbus's trainer, one optimizer step per batch.

TRL's layout (trl 1.16.0 ``GRPOTrainer._generate_and_score_completions`` / ``_compute_loss``): the step's
samples are one generation batch, prompts left-padded and completions right-padded to its longest,
shuffled, split into micro-batches of ``per_device_train_batch_size`` (8) rows; the default loss
``dapo`` on-policy (ratio to the detached logprobs, clip 0.2, beta 0, summed over completion tokens /
the batch's completion tokens); its per-micro-batch metric reads (``.item()``); fused AdamW (lr 1e-6)
and gradient clipping at 1.0 (TrainingArguments' defaults). What differs is the logprob path:
``trl`` TRL 1.16's ``add_fused_lm_head``; ``trl_logits`` TRL < 1.0's ``logits_to_keep`` +
``selective_log_softmax``; ``trl_liger`` TRL < 1.0's ``use_liger_loss`` path (liger-kernel's
``LigerFusedLinearGRPOLoss`` on the backbone's hidden states). TRL's and Liger's own functions run when
installed (the ``bench`` extra); ``resolve`` says which ran, or why a baseline is skipped.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import numpy as np
import torch

__all__ = ["BASELINES", "TRL_MICRO_ROWS", "build_baseline", "hf_step", "resolve"]

BASELINES = {
    "hf": "plain HF: per group of 8, right-padded, full logits, float32 log-softmax",
    "trl": "TRL 1.16 GRPOTrainer: add_fused_lm_head (head on completion positions only, no full logits)",
    "trl_ckpt": "trl with gradient checkpointing (GRPOConfig's default)",
    "trl_logits": "TRL < 1.0: logits_to_keep, selective_log_softmax",
    "trl_liger": "TRL < 1.0 use_liger_loss: LigerFusedLinearGRPOLoss on the hidden states",
}
"""Baseline name -> what it computes (each also as ``NAME+bf16``: bfloat16 parameters)."""

TRL_MICRO_ROWS = 8  # per_device_train_batch_size: TrainingArguments' default
EPSILON = 0.2  # GRPOConfig.epsilon (epsilon_high defaults to it)
CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (1.16.0)
MISSING = "not installed (pip install -e '.[bench]': trl==1.16.0, liger-kernel)"


@functools.cache
def _trl_utils():
    """trl.trainer.utils's functions, or the ImportError's text."""
    try:
        import trl
        from trl.trainer.utils import add_fused_lm_head, entropy_from_logits, selective_log_softmax
    except ImportError as e:
        return str(e)
    return {
        "version": trl.__version__,
        "fused": add_fused_lm_head,
        "sls": selective_log_softmax,
        "ent": entropy_from_logits,
    }


@functools.cache
def _trl_kernel():
    """trl.kernels' ChunkedLogProbFunction (needs only torch and transformers), or the ImportError's text."""
    try:
        import trl
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError as e:
        return str(e)
    return {"version": trl.__version__, "fn": ChunkedLogProbFunction}


@functools.cache
def _liger():
    try:
        from importlib.metadata import version

        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as e:
        return str(e)
    return {"version": version("liger-kernel"), "cls": LigerFusedLinearGRPOLoss}


def resolve(name: str) -> tuple[str | None, str]:
    """``(kind, source)`` of baseline `name` (no ``+bf16``): kind ``"trl"``/``"liger"`` when TRL's or
    Liger's own functions run, ``"own"`` for this module's code, None when skipped (source: why)."""
    if name == "hf":
        return "own", "own code (bench/gpu_baselines_trl.py hf_step)"
    if name in ("trl", "trl_ckpt"):
        utils = _trl_utils()
        if isinstance(utils, dict):
            return "trl", f"trl {utils['version']}: trl.trainer.utils.add_fused_lm_head"
        kernel = _trl_kernel()
        if isinstance(kernel, dict):  # the device image may lack datasets/pandas: TRL's kernel, its wrapper here
            return "trl", f"trl {kernel['version']}: ChunkedLogProbFunction (trl.trainer.utils: {utils})"
        return None, f"trl {MISSING}: {kernel}"
    if name == "trl_logits":
        utils = _trl_utils()
        if isinstance(utils, dict):
            return "trl", f"trl {utils['version']}: trl.trainer.utils.selective_log_softmax, entropy_from_logits"
        return "own", f"own selective_log_softmax / entropy_from_logits (TRL's torch path re-done; trl: {utils})"
    if name == "trl_liger":
        liger = _liger()
        if isinstance(liger, dict):
            return "liger", f"liger-kernel {liger['version']}: LigerFusedLinearGRPOLoss"
        return None, f"liger-kernel {MISSING}: {liger}"
    raise ValueError(f"unknown baseline {name!r}; known: {sorted(BASELINES)}")


def _selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[index] row by row ([B, T, V], [B, T] -> [B, T]): TRL's torch path."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index[..., None])[..., 0]
        return picked - torch.stack([torch.logsumexp(row, -1) for row in logits])
    return torch.stack([torch.log_softmax(r, -1).gather(-1, i[:, None])[:, 0] for r, i in zip(logits, index)])


def _entropy(logits: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Entropy in nats per position ([..., V] -> [...]), 128 rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = [-(torch.exp(lp) * lp).sum(-1) for lp in (torch.log_softmax(c, -1) for c in flat.split(chunk))]
    return torch.cat(out).reshape(logits.shape[:-1])


def trl_layout(samples, device: torch.device, rng: np.random.Generator, rows: int = TRL_MICRO_ROWS) -> dict:
    """The step as TRL lays it out: ``micro`` (dicts of ``ids``/``attn`` [rows, P + C] int64,
    ``comp``/``comp_mask`` [rows, C], ``adv`` [rows] float32; P, C the batch's longest prompt and
    completion) and ``num_items`` (the batch's completion tokens, a float32 tensor)."""
    n = len(samples)
    width_p = max(int((~m).sum()) for _, m, _ in samples)
    width_c = max(int(m.sum()) for _, m, _ in samples)
    ids = np.zeros((n, width_p + width_c), np.int64)
    attn = np.zeros((n, width_p + width_c), np.int64)
    for i, (s, m, _) in enumerate(samples):
        p, c = s[~m], s[m]
        ids[i, width_p - len(p) : width_p + len(c)] = np.concatenate([p, c])
        attn[i, width_p - len(p) : width_p + len(c)] = 1
    adv = np.array([a for _, _, a in samples], np.float32)
    perm = rng.permutation(n)  # shuffle_sequence_dict
    ids, attn, adv = (torch.from_numpy(x[perm]).to(device) for x in (ids, attn, adv))
    micro = [
        {
            "ids": ids[k : k + rows],
            "attn": attn[k : k + rows],
            "comp": ids[k : k + rows, width_p:],
            "comp_mask": attn[k : k + rows, width_p:],
            "adv": adv[k : k + rows],
        }
        for k in range(0, n, rows)
    ]
    return {"micro": micro, "num_items": attn[:, width_p:].sum().float()}


def _fused_head_fallback(model, ids, attn, labels, fn):
    """add_fused_lm_head's forward (trl 1.16.0) around TRL's own kernel: backbone, then the head on the
    positions with a label (every position where Triton is absent), log-probs and entropy [B, L - 1]."""
    hidden = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]
    labels = labels[:, 1:]
    mask = labels != -100
    weight = model.get_output_embeddings().weight
    compact = hidden.device.type == "cuda"
    h = hidden[mask] if compact else hidden.reshape(-1, hidden.shape[-1])
    t = labels[mask] if compact else labels.clamp(min=0).reshape(-1)
    lp, ent, *_ = fn.apply(h, weight, None, t, 1.0, CHUNK, None, 1.0, ("log_probs", "entropy"))
    if compact:
        return lp.new_zeros(mask.shape).masked_scatter(mask, lp), ent.new_zeros(mask.shape).masked_scatter(mask, ent)
    return lp.view(mask.shape).masked_fill(~mask, 0), ent.view(mask.shape).masked_fill(~mask, 0)


def _logps(name: str, model, mb: dict):
    """Per-token log-probs and entropies of the completion positions ([rows, C]) by `name`'s path."""
    ids, attn, keep = mb["ids"], mb["attn"], mb["comp"].shape[1]
    if name == "trl_logits":
        utils = _trl_utils()
        sls, ent = (utils["sls"], utils["ent"]) if isinstance(utils, dict) else (_selective_log_softmax, _entropy)
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep + 1, use_cache=False).logits
        logits = logits[:, :-1] / 1.0  # TRL < 1.0 divides by the temperature out of place
        with torch.no_grad():
            entropies = ent(logits)
        return sls(logits, mb["comp"]), entropies
    labels = ids.masked_fill(attn == 0, -100)  # only the completion tokens are scored
    labels[:, :-keep] = -100
    utils = _trl_utils()
    if isinstance(utils, dict):
        out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -keep:], out.entropy[:, -keep:]
    lp, ent = _fused_head_fallback(model, ids, attn, labels, _trl_kernel()["fn"])
    return lp[:, -keep:], ent[:, -keep:]


def _dapo(logps, adv, mask, num_items):
    """GRPOTrainer's default loss, on-policy: -min(r A, clip(r, 1 -+ eps) A) summed over the completion
    tokens / the batch's completion tokens; also the ratio r."""
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    return (per_token * mask).sum() / num_items, coef_1


def _metrics(coef_1, adv, mask, entropies) -> None:
    """GRPOTrainer's per-micro-batch metric reads: entropy and clip ratios, each one host read."""

    def masked_mean(x):
        return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

    masked_mean(entropies)
    low = (coef_1 < 1 - EPSILON) & (adv[:, None] < 0)
    high = (coef_1 > 1 + EPSILON) & (adv[:, None] > 0)
    for x in (low, high, low | high):
        masked_mean(x.float())
    per_seq = lambda x: (x.float() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    per_seq(low).min().item(), per_seq(high).max().item()


def build_baseline(name: str, model, device: torch.device, rng: np.random.Generator, autocast: bool = True):
    """``step(groups) -> loss`` for baseline `name` (no ``+bf16``) on `model` (already on `device`, in
    its parameter dtype), its fused AdamW and bf16 `autocast`; ValueError if `name` is skipped."""
    from bench.gpu_trainer_batches import samples_of

    kind, source = resolve(name)
    if kind is None:
        raise ValueError(f"{name}: {source}")
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    if name == "hf":  # as in the earlier runs: torch's default AdamW, no clipping
        optimizer = torch.optim.AdamW(params, lr=1e-6)
        return lambda groups: hf_step(model, optimizer, groups, device, autocast)
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=True)
    if name == "trl_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if name in ("trl", "trl_ckpt") and isinstance(_trl_utils(), dict):
        _trl_utils()["fused"](model, outputs=("log_probs", "entropy"))
    liger = None
    if name == "trl_liger":  # Liger compiles its loss math on GPUs; on CPU Inductor's C++ build costs minutes
        liger = _liger()["cls"](beta=0.0, use_ref_model=False, loss_type="dapo", compiled=device.type == "cuda")

    def step(groups) -> float:
        optimizer.zero_grad(set_to_none=True)
        batch = trl_layout(samples_of(groups), device, rng)
        total = torch.zeros((), device=device)
        for mb in batch["micro"]:
            mask = mb["comp_mask"].float()
            with autocast:
                if liger is not None:
                    keep = mb["comp"].shape[1]
                    out = model.model(input_ids=mb["ids"], attention_mask=mb["attn"], use_cache=False)
                    hidden = out.last_hidden_state[:, :-1][:, -keep:]
                    head = model.get_output_embeddings()
                    loss, metrics = liger(
                        hidden, head.weight, mb["comp"], mb["comp_mask"], mb["adv"], bias=head.bias,
                        num_items_in_batch=batch["num_items"],
                    )  # fmt: skip
                else:
                    logps, entropies = _logps(name, model, mb)
            if liger is None:
                loss, coef_1 = _dapo(logps.float(), mb["adv"], mask, batch["num_items"])
            loss.backward()
            if liger is None:
                _metrics(coef_1.detach(), mb["adv"], mask, entropies.detach())
            else:
                metrics[-1].mean().item()  # TRL's clip_ratio read
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return float(total)

    return step


def hf_step(model, optimizer, groups, device, autocast=None) -> float:
    """One plain HF policy-gradient step (right-padded per group of 8, full logits, float32
    log-softmax, -(A logp) over the loss tokens / the batch's loss tokens); returns the loss."""
    from bench.gpu_trainer_batches import GROUP, samples_of

    optimizer.zero_grad(set_to_none=True)
    samples = samples_of(groups)
    loss_tokens = sum(int(mask.sum()) for _, mask, _ in samples)
    total = 0.0
    for start in range(0, len(samples), GROUP):
        group = samples[start : start + GROUP]
        width = max(len(ids) for ids, _, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        adv = torch.tensor([a for _, _, a in group])
        for i, (sample_ids, loss_mask, _) in enumerate(group):
            n = len(sample_ids)
            ids[i, :n], attn[i, :n] = torch.from_numpy(sample_ids.astype(np.int64)), 1
            mask[i, :n] = torch.from_numpy(loss_mask)
        ids, attn, mask, adv = ids.to(device), attn.to(device), mask.to(device), adv.to(device)
        with autocast or nullcontext():
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(adv[:, None] * logp * mask[:, 1:]).sum() / loss_tokens
        loss.backward()
        total += loss.item()
        del logits, logp, loss
    optimizer.step()
    return total
