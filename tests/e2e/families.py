"""The model-family checks of the end-to-end runs: each family (policies.model_families) trains a few steps
through ``busctl up`` as part of another run: Qwen2.5 tied in tests/e2e/test_bus_weights_run.py, Qwen3 tied in
tests/e2e/test_fuzz_run.py, Llama-3 untied in tests/e2e/test_task_runs.py's GSM8K run.

Checks (:func:`assert_family_run`): every step's loss is finite; with ``max_async_level=0`` every trained token
was sampled under the weights being trained, and the producers' logprobs equal the trainer's (< 1e-3 nats) at
every step: step 1 on the checkpoint's weights, later steps after a weight reload (a tied lm_head left stale in
vLLM would show here); the prompts were rendered with the family's chat template and the completions the
reward saw carry no end-of-turn token.
"""

from __future__ import annotations

import math
from pathlib import Path

from policies.model_families import build_family_model, family
from tests.e2e.test_pipeline import read_jsonl

TIED = {"qwen2.5": True, "qwen3": True, "llama3": False}
PROMPT_START = {
    "qwen2.5": "<|im_start|>system\nYou are Qwen",
    "qwen3": "<|im_start|>",
    "llama3": "<|begin_of_text|><|start_header_id|>",
}
FAMILY_OVERRIDES = ("max_async_level=0", "report.samples_interval=1", "report.samples_per_step=16")
"""What a family run needs beside its policy: on-policy steps and every step's samples kept."""
REVERSE_TEXT_OVERRIDES = (
    *FAMILY_OVERRIDES,
    "model.max_model_len=512",
    "eval.eval_base_model=false",
    "eval.tasks=[{name: reverse_text, num_examples: 4}]",
)
"""A family run on the reverse_text task: the families' checkpoints allow long contexts, 512 tokens suffice."""


def family_policy(root: Path, name: str) -> Path:
    """A tiny random checkpoint of family ``name`` (tied as its small checkpoints ship) under ``root``."""
    return build_family_model(root / name, name, tied=TIED[name], seed=0)


def assert_family_run(run_dir: Path, name: str, max_steps: int) -> None:
    """The module docstring's checks on the finished run in ``run_dir`` of family ``name``'s policy."""
    fam = family(name)
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, max_steps + 1))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps)
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3, [m["onpolicy_lp_diff_max"] for m in steps]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert {s["step"] for s in samples} == set(range(max_steps))
    for s in samples:
        assert s["prompt"].startswith(PROMPT_START[name]) and s["prompt"].count(fam.eos) >= 1
        assert not any(t in s["completion"] for t in fam.stop)
