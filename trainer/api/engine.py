"""The trainer's side of ``busctl serve``, socket-free: training clients' models (LoRA adapters or full
copies, each with its own AdamW) held in memory, and one :meth:`ApiEngine.handle` per call of the ``api``
topic. Gradients accumulate over ``forward_backward`` calls until ``optim_step``; the calls of one model
arrive in ``seq_id`` order (the API process orders them). Datums whose targets are the next input tokens
run through the packed forward (:mod:`trainer.forward.packed`); others through the plain HF forward.
Checkpoints are Hugging Face directories under ``RUN_DIR/api/`` named by ``tinker://`` paths.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bus.messages import new_id
from bus.messages_api import ApiCall, ApiReply
from configs.schema import LoraSection, RunConfig
from trainer.api.tinker_losses import token_loss
from trainer.forward.packed import packed_logprobs_and_entropy
from trainer.forward.precision import PrecisionPolicy
from runfiles.api_checkpoints import checkpoint_dir
from trainer.state.model import load_policy, policy_state_dict

log = logging.getLogger(__name__)

PACK_TOKENS = 8192
"""Most tokens per packed forward; a call's datums are split into packs of this size (gradients add up)."""
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class UserError(ValueError):
    """A call the client got wrong (unknown model, bad inputs): answered with category ``user``."""


@dataclass
class ServedModel:
    """One training client's model: ``lora`` (None: full fine-tuning) as created; ``steps``: optimizer steps."""

    model_id: str
    base_model: str
    path: str
    lora: dict | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    steps: int = 0


class ApiEngine:
    """Runs :class:`ApiCall` s on the models of ``cfg``'s served base models (``model.path``, ``serve.models``)."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.device = torch.device("cuda" if cfg.trainer.device == "cuda" else "cpu")
        self.precision = PrecisionPolicy.from_name(cfg.trainer.dtype)
        self.models: dict[str, ServedModel] = {}
        self.served = {m: m for m in [cfg.model.path, *cfg.serve.models] if m}
        self.engine_id = new_id()
        """Names this process in every reply: a new one tells the API process the calls in flight were lost."""

    def handle(self, call: ApiCall) -> ApiReply:
        """Run ``call``; errors become a failed reply (``user`` for bad calls, ``server`` otherwise)."""
        op = getattr(self, f"_op_{call.op}", None)
        started = time.perf_counter()
        try:
            if op is None:
                raise UserError(f"unknown call {call.op!r}")
            body, outputs = op(call)
        except (UserError, KeyError, TypeError, ValueError) as err:  # ValueError: rlbus's own input checks
            return self._failed(call, str(err), "user")
        except Exception as err:
            log.exception("api call %s on %s failed", call.op, call.model_id)
            return self._failed(call, f"{type(err).__name__}: {err}", "server")
        body["elapsed_s"] = time.perf_counter() - started
        body["engine"] = self.engine_id
        return ApiReply(id=new_id(), call_id=call.id, ok=True, error="", category="", body=body, outputs=outputs)

    def _failed(self, call: ApiCall, error: str, category: str) -> ApiReply:
        body = {"engine": self.engine_id}
        return ApiReply(id=new_id(), call_id=call.id, ok=False, error=error, category=category, body=body)

    def _op_ping(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        return {}, _NONE

    # -- models ----------------------------------------------------------------------------------

    def _get(self, model_id: str) -> ServedModel:
        if model_id not in self.models:
            raise UserError(f"no model {model_id!r} on this server (create it first)")
        return self.models[model_id]

    def _build(self, model_id: str, base_model: str, lora: dict | None) -> ServedModel:
        path = self.served.get(base_model)
        if path is None:
            raise UserError(f"base model {base_model!r} is not served here; served: {sorted(self.served)}")
        if lora is None and not self.cfg.serve.full_finetune:
            raise UserError("full fine-tuning is off on this server (serve.full_finetune); ask for a LoRA rank")
        section = LoraSection(enabled=False)
        if lora is not None:
            targets = [
                *(ATTN_MODULES if lora.get("train_attn", True) else ()),
                *(MLP_MODULES if lora.get("train_mlp", True) else ()),
            ]
            if not targets:
                raise UserError("a LoRA client must train attention or MLP layers (train_attn / train_mlp)")
            section = LoraSection(
                enabled=True, rank=int(lora["rank"]), alpha=self.cfg.trainer.lora.alpha, target_modules=targets
            )
            if lora.get("seed") is not None:
                torch.manual_seed(int(lora["seed"]))
        model = load_policy(path, section).to(self.device)
        head = _untied_head(model) if lora is not None and lora.get("train_unembed", True) else None
        if head is not None:  # train_unembed (the SDK's default): the LM head trains in full beside the adapter
            head[1].weight.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        return ServedModel(model_id, base_model, path, lora, model, optimizer)

    def _op_create_model(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        if call.model_id in self.models:  # a retried create: the model is there
            return {"model_id": call.model_id}, _NONE
        self.models[call.model_id] = self._build(call.model_id, call.body["base_model"], call.body.get("lora"))
        log.info("created model %s (%s, lora %s)", call.model_id, call.body["base_model"], call.body.get("lora"))
        return {"model_id": call.model_id}, _NONE

    def _op_unload_model(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        self.models.pop(call.model_id, None)
        return {}, _NONE

    def _op_get_info(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        sm = self._get(call.model_id)
        return {
            "model_id": sm.model_id,
            "base_model": sm.base_model,
            "tokenizer_id": sm.path,
            "is_lora": sm.lora is not None,
            "lora_rank": sm.lora["rank"] if sm.lora else None,
            "arch": type(getattr(sm.model, "base_model", sm.model)).__name__,
        }, _NONE

    # -- forward / backward ----------------------------------------------------------------------

    def _op_forward_backward(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        sm = self._get(call.model_id)
        body = call.body
        names = list(body.get("loss_inputs", []))
        if len(names) != len(call.loss_inputs):
            raise UserError("loss_inputs names and rows differ")
        rows = dict(zip(names, call.loss_inputs))
        target_name = "target_tokens" if "target_tokens" in rows else "labels"
        if target_name not in rows:
            raise UserError("loss_fn_inputs needs target_tokens (or labels)")
        forward_only = bool(body.get("forward_only", False))
        config = dict(body.get("loss_fn_config") or {})
        ids, lens = np.asarray(call.token_ids), np.asarray(call.datum_lens)
        logprobs_out = np.zeros(len(ids))
        loss_out = np.zeros(len(ids))
        metrics: dict[str, float] = {"loss:sum": 0.0}
        starts = np.concatenate([[0], np.cumsum(lens)])
        for first, last in _packs(lens):
            lo, hi = int(starts[first]), int(starts[last])
            labels = rows[target_name][lo:hi]
            targets = np.where(labels < 0, 0, labels)  # xorl's ignore index (-100): masked below
            with torch.set_grad_enabled(not forward_only):
                lp = self._target_logprobs(sm.model, ids[lo:hi], lens[first:last], targets)
                inputs = {
                    k: torch.as_tensor(v[lo:hi], dtype=torch.float32, device=lp.device)
                    for k, v in rows.items()
                    if k != target_name
                }
                inputs["labels_mask"] = torch.as_tensor(labels >= 0, device=lp.device)
                seq_lens = torch.as_tensor(lens[first:last], device=lp.device)
                per_token, pack_metrics = token_loss(body["loss_fn"], lp, inputs, config, seq_lens)
                loss = per_token.sum()
            if not forward_only and per_token.numel():
                loss.backward()
            logprobs_out[lo:hi] = lp.detach().cpu().double().numpy()
            loss_out[lo:hi] = per_token.detach().cpu().double().numpy()
            metrics["loss:sum"] += float(loss.detach())
            _merge_metrics(metrics, pack_metrics, weight=(hi - lo) / max(len(ids), 1))
        outputs = np.stack([logprobs_out, loss_out]) if len(ids) else np.zeros((2, 0))
        return {"outputs": ["logprobs", "elementwise_loss"], "metrics": metrics}, outputs

    def _target_logprobs(
        self, model: torch.nn.Module, ids: np.ndarray, lens: np.ndarray, targets: np.ndarray
    ) -> torch.Tensor:
        """``[sum(lens)]`` float32 ``log p(target_t | ids_<=t)`` of each datum, through one packed forward of the
        datums whose targets are their next tokens (each packed as ``ids + [last target]``), the plain HF
        forward for the others. UserError for a target outside the vocabulary."""
        tgt = np.asarray(targets).astype(np.int64)
        vocab = model.get_output_embeddings().weight.shape[0]
        if len(tgt) and (tgt.min() < 0 or tgt.max() >= vocab):
            raise UserError(f"target_tokens must be token ids in [0, {vocab})")
        starts = np.concatenate([[0], np.cumsum(lens)])
        shifted = [n > 0 and np.array_equal(ids[s + 1 : s + n], tgt[s : s + n - 1]) for s, n in zip(starts[:-1], lens)]
        pieces: dict[int, torch.Tensor] = {}
        packed = [i for i, ok in enumerate(shifted) if ok]
        with self.precision.autocast(self.device):
            if packed:
                row = np.concatenate(
                    [np.append(ids[starts[i] : starts[i + 1]], tgt[starts[i + 1] - 1]) for i in packed]
                )
                row_lens = np.array([lens[i] + 1 for i in packed], dtype=np.int64)
                lp, _entropy = packed_logprobs_and_entropy(
                    model, row, row_lens, head_dtype=self.cfg.trainer.lm_head_dtype
                )
                at = 0
                for i, n in zip(packed, row_lens):
                    pieces[i] = lp[at + 1 : at + n]
                    at += int(n)
            for i, ok in enumerate(shifted):
                if ok or lens[i] == 0:
                    pieces.setdefault(i, torch.zeros(0, device=self.device))
                    continue
                x = torch.as_tensor(ids[starts[i] : starts[i + 1]], device=self.device)[None]
                logits = model(input_ids=x, use_cache=False).logits[0].float()
                y = torch.as_tensor(tgt[starts[i] : starts[i + 1]], device=self.device)
                pieces[i] = torch.log_softmax(logits, -1).gather(1, y[:, None])[:, 0]
        return torch.cat([pieces[i].float() for i in range(len(lens))]) if len(lens) else torch.zeros(0)

    # -- optimizer -------------------------------------------------------------------------------

    def _op_optim_step(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        sm = self._get(call.model_id)
        p = call.body.get("adam_params") or {}
        for group in sm.optimizer.param_groups:
            group["lr"] = float(p.get("learning_rate", 1e-4))
            group["betas"] = (float(p.get("beta1", 0.9)), float(p.get("beta2", 0.95)))
            group["eps"] = float(p.get("eps", 1e-12))
            group["weight_decay"] = float(p.get("weight_decay", 0.0))
        params = [q for q in sm.model.parameters() if q.requires_grad]
        clip = float(p.get("grad_clip_norm", 0.0))
        grads = [q.grad for q in params if q.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))) if grads else 0.0
        sm.optimizer.step()
        sm.optimizer.zero_grad(set_to_none=True)
        sm.steps += 1
        return {"metrics": {"grad_norm:mean": norm, "step:max": float(sm.steps)}}, _NONE

    # -- checkpoints -----------------------------------------------------------------------------

    def _op_save_weights(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        sm = self._get(call.model_id)
        kind = "sampler_weights" if call.body.get("kind") == "sampler" else "weights"
        name = call.body.get("name") or f"{sm.steps:06d}"
        tinker_path = f"tinker://{sm.model_id}/{kind}/{name}"
        out = _checkpoint_dir(self.run_dir, tinker_path)
        out.mkdir(parents=True, exist_ok=True)
        if kind == "weights":
            sm.model.save_pretrained(out)
            if sm.lora is not None:
                _save_trained_head(sm.model, out)
            torch.save(sm.optimizer.state_dict(), out / "optimizer.pt")
        else:  # what the sampler loads: the whole policy, a LoRA adapter merged in
            from safetensors.torch import save_file

            merged = {k: v.detach().to("cpu", torch.float32).clone() for k, v in policy_state_dict(sm.model).items()}
            save_file(merged, out / "model.safetensors")
        meta = {"base_model": sm.base_model, "lora": sm.lora, "steps": sm.steps, "model_id": sm.model_id}
        (out / "rlbus_api.json").write_text(json.dumps(meta))
        return {"path": tinker_path, "weights_dir": str(out)}, _NONE

    def _op_load_weights(self, call: ApiCall) -> tuple[dict, np.ndarray]:
        src = _checkpoint_dir(self.run_dir, call.body["path"])
        if "/sampler_weights/" in call.body["path"]:
            raise UserError("a sampler checkpoint holds merged weights for sampling; load a save_state path")
        if not (src / "rlbus_api.json").is_file():
            raise UserError(f"no checkpoint at {call.body['path']}")
        meta = json.loads((src / "rlbus_api.json").read_text())
        sm = self.models.get(call.model_id)
        if sm is None:  # create_training_client_from_state: a new model of the checkpoint's kind
            sm = self.models[call.model_id] = self._build(call.model_id, meta["base_model"], meta["lora"])
        if (sm.lora is None) != (meta["lora"] is None):
            raise UserError("the checkpoint and the model differ in LoRA vs full weights")
        _load_weights(sm.model, src, lora=meta["lora"] is not None)
        sm.optimizer.zero_grad(set_to_none=True)
        if call.body.get("optimizer"):
            if not (src / "optimizer.pt").is_file():
                raise UserError(f"{call.body['path']} holds no optimizer state (a sampler checkpoint)")
            sm.optimizer.load_state_dict(torch.load(src / "optimizer.pt", map_location=self.device))
            sm.steps = int(meta["steps"])
        return {"path": call.body["path"], "model_id": call.model_id}, _NONE


_NONE = np.zeros((0, 0))


def _checkpoint_dir(run_dir: Path, tinker_path: str) -> Path:
    try:
        return checkpoint_dir(run_dir, tinker_path)
    except ValueError as err:
        raise UserError(str(err)) from err


def _merge_metrics(into: dict[str, float], pack: dict[str, float], weight: float) -> None:
    """Fold one pack's ``name:reduction`` metrics into the call's (means weighted by the pack's tokens)."""
    for key, value in pack.items():
        kind = key.rpartition(":")[2]
        if key not in into:
            into[key] = value * weight if kind == "mean" else value
        elif kind == "mean":
            into[key] += value * weight
        elif kind == "min":
            into[key] = min(into[key], value)
        elif kind == "max":
            into[key] = max(into[key], value)
        else:
            into[key] += value


def _packs(lens: np.ndarray) -> list[tuple[int, int]]:
    """``(first, last)`` datum ranges of at most :data:`PACK_TOKENS` tokens each (a longer datum alone)."""
    out, first, tokens = [], 0, 0
    for i, n in enumerate(lens):
        if i > first and tokens + n > PACK_TOKENS:
            out.append((first, i))
            first, tokens = i, 0
        tokens += int(n)
    if len(lens):
        out.append((first, len(lens)))
    return out


@torch.no_grad()
def _load_weights(model: torch.nn.Module, src: Path, *, lora: bool) -> None:
    """Copy the saved weights of ``src`` (peft adapter or full HF model) into ``model`` in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if lora:
        state = load_file(src / "adapter_model.safetensors")
        name, head = _untied_head(model) or ("", None)
        saved = state.pop(f"{PEFT_PREFIX}{name}.weight", None) if head is not None else None
        if (saved is not None) != (head is not None and head.weight.requires_grad):
            raise UserError("the checkpoint and the model differ in train_unembed (a trained LM head)")
        set_peft_model_state_dict(model, state)
        if saved is not None:
            head.weight.copy_(saved)
        return
    state: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise UserError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


PEFT_PREFIX = "base_model.model."
"""peft's prefix of a module's tensors in ``adapter_model.safetensors`` (a ``modules_to_save`` head included)."""


def _untied_head(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(module name, module)`` of the LM head, None when it shares its weight with the input embeddings."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(n for n, m in inner.named_modules() if m is head), head


@torch.no_grad()
def _save_trained_head(model: torch.nn.Module, out: Path) -> None:
    """Add a LoRA client's trained LM head to its peft files as peft writes a ``modules_to_save`` head, so
    ``PeftModel.from_pretrained`` reads it."""
    from safetensors.torch import load_file, save_file

    name, head = _untied_head(model) or ("", None)
    if head is None or not head.weight.requires_grad:
        return
    state = load_file(out / "adapter_model.safetensors")
    state[f"{PEFT_PREFIX}{name}.weight"] = head.weight.detach().to("cpu").clone()
    save_file(state, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "adapter_config.json").read_text())
    config["modules_to_save"] = sorted({*(config.get("modules_to_save") or []), name})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
