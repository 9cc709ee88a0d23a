"""Checkpoints are complete Hugging Face model directories, and ``busctl export`` writes them
(full, LoRA adapter, LoRA merged) without the training state: loaded back with real transformers,
peft and (one short generation) vLLM.

The checkpoints are written by :func:`trainer.state.checkpoint.save_checkpoint` of a tiny random
Qwen3 policy (the default policy's architecture and byte tokenizer) whose weights (or LoRA ``B``)
were moved off their initial values, so a loader that fell back to the base weights would be seen.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from busctl.cli import main
from busctl.export import ExportError, export_checkpoint, find_checkpoint
from configs.schema import LoraSection, TrainerConfig, OptimConfig
from policies.tiny_model import build_random_policy
from tests.torch_threads import one_torch_thread  # noqa: F401 - autouse fixture
from trainer.state.model import load_policy
from trainer.state.checkpoint import save_checkpoint
from trainer.trainer import build_optimizer

CFG = TrainerConfig(optim=OptimConfig(lr=1e-3))
LORA = LoraSection(enabled=True, rank=4, alpha=8.0, dropout=0.0)
MESSAGES = [{"role": "user", "content": "Reverse: abc"}]
TRAINING_STATE = {"optimizer.pt", "rng.json", "meta.json", "DONE"}


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add N(0, 0.05) noise to every trainable weight (a stand-in for training)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model.eval()(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two run directories with a checkpoint each (steps 3 and 5 for full, 2 for LoRA), and the
    models as they were saved."""
    tmp = tmp_path_factory.mktemp("export")
    policy = build_random_policy(tmp / "policy", hidden_size=32, num_layers=1, seed=0)
    full = _moved(load_policy(str(policy), LoraSection()), seed=1)
    for step in (3, 5):
        save_checkpoint(
            tmp / "full_run" / "checkpoints",
            step=step,
            model=full,
            optimizer=build_optimizer(full, CFG),
            extra={"policy_version": step},
        )
    torch.manual_seed(2)
    lora = load_policy(str(policy), LORA)
    with torch.no_grad():  # B starts at 0 (the adapter is a no-op): make it count
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    save_checkpoint(
        tmp / "lora_run" / "checkpoints", step=2, model=lora, optimizer=build_optimizer(lora, CFG), extra={}
    )
    return {"tmp": tmp, "policy": policy, "full": full.eval(), "lora": lora.eval()}


def test_full_checkpoint_loads_as_a_model_directory(run):
    ckpt = find_checkpoint(run["tmp"] / "full_run", None)
    assert ckpt.name == "step_000005"
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    source = AutoTokenizer.from_pretrained(run["policy"])
    assert tokenizer.chat_template and tokenizer.chat_template == source.chat_template
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == source.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (ckpt / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.testing.assert_close(_logits(loaded, ids), _logits(run["full"], ids), rtol=0, atol=0)
    as_model_path = load_policy(str(ckpt), LoraSection())  # a new run's model.path
    torch.testing.assert_close(_logits(as_model_path, ids), _logits(run["full"], ids), rtol=0, atol=0)


def test_lora_checkpoint_holds_the_tokenizer_and_the_base_generation_config(run):
    ckpt = find_checkpoint(run["tmp"] / "lora_run", None)
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] is not None
    assert (
        Path(json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"])
        == run["policy"].resolve()
    )


def test_export_full_leaves_the_training_state_out_and_vllm_samples_it(run, tmp_path):
    pytest.importorskip("vllm")
    from producers.engine import RolloutEngine
    from tests.producers.test_weight_sync import LOGPROB_ATOL, _hf_logprobs, assert_no_leftover_processes

    out = tmp_path / "exported"
    assert main(["export", str(run["tmp"] / "full_run"), "--step", "3", "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert not names & TRAINING_STATE and not any(n.endswith(".pt") for n in names)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    loop = asyncio.new_event_loop()
    engine = RolloutEngine(out, max_model_len=128, kv_cache_bytes=16 * 1024**2)
    try:
        loop.run_until_complete(engine.start())
        samples = loop.run_until_complete(
            engine.generate_group(
                ids, n=2, temperature=1.0, top_p=1.0, max_tokens=6, request_id="export", ignore_eos=True
            )
        )
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
        assert_no_leftover_processes()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for sample in samples:
        assert len(sample.token_ids) == 6
        err = (_hf_logprobs(hf, ids, list(sample.token_ids)) - torch.tensor(sample.logprobs)).abs().max().item()
        assert err < LOGPROB_ATOL, f"vLLM's logprobs of the exported model differ from transformers' by {err}"


def test_export_lora_adapter_in_peft_format(run, tmp_path):
    out = export_checkpoint(find_checkpoint(run["tmp"] / "lora_run", 2), tmp_path / "adapter")
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and not names & TRAINING_STATE
    base = AutoModelForCausalLM.from_pretrained(run["policy"], dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    base_logits = _logits(base, ids)
    peft = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(_logits(peft, ids), _logits(run["lora"], ids), rtol=0, atol=1e-6)
    assert not torch.allclose(base_logits, _logits(peft, ids), atol=1e-3), "the adapter should change the logits"


def test_export_lora_merged(run, tmp_path):
    out = tmp_path / "merged"
    assert main(["export", str(run["tmp"] / "lora_run"), "--out", str(out), "--merge-lora"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "adapter_config.json" not in names and {"model.safetensors", "config.json", "tokenizer.json"} <= names
    umask = os.umask(0)
    os.umask(umask)  # save_pretrained writes model.safetensors 0600; the export gives every file the default mode
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == dict.fromkeys(names, oct(0o666 & ~umask))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    torch.testing.assert_close(_logits(merged, ids), _logits(run["lora"], ids), rtol=1e-5, atol=1e-5)


def test_export_refuses_a_missing_step_and_a_used_output(run, tmp_path):
    with pytest.raises(ExportError, match=r"no complete checkpoint of step 4 .*\[3, 5\]"):
        find_checkpoint(run["tmp"] / "full_run", 4)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert main(["export", str(run["tmp"] / "full_run"), "--out", str(used)]) == 1
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
