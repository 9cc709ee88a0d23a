"""Tests for configs.schema: shipped configs load, dotted overrides, error messages, round trip,
and ``busctl up --dry-run``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from busctl.components.placement import apply_placement
from configs.schema import CONFIG_DIR, ConfigError, RunConfig, dump_config, load_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))
DEFAULT = "reverse_text.yaml"


def test_there_are_shipped_configs():
    assert DEFAULT in [p.name for p in SHIPPED]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    raw = yaml.safe_load(path.read_text())
    # what the file says is what the model holds (spot-check every top-level scalar and section key)
    for key, value in raw.items():
        if isinstance(value, dict):
            section = getattr(cfg, key).model_dump(mode="json")
            for sub, sub_value in value.items():
                if isinstance(sub_value, list) and sub_value and isinstance(sub_value[0], dict):
                    # a list of sections: every key given in the file holds its value
                    assert [{k: item[k] for k in given} for item, given in zip(section[sub], sub_value)] == sub_value, (
                        f"{key}.{sub}"
                    )
                elif not isinstance(sub_value, dict):
                    assert section[sub] == sub_value, f"{key}.{sub}"
        else:
            assert getattr(cfg, key) == value, key
    assert cfg.trainer.batch_size % cfg.producers.group_size == 0
    assert cfg.prompts_per_step * cfg.producers.group_size == cfg.trainer.batch_size


def test_default_path_is_reverse_text():
    assert load_config() == load_config(CONFIG_DIR / DEFAULT)
    # reverse_text.yaml: batch_size 128, group_size 8 -> 16 prompts per step
    assert load_config().prompts_per_step == 128 // 8


def test_dotted_overrides_apply_and_are_typed():
    cfg = load_config(
        None,
        [
            "trainer.max_steps=5",
            "trainer.optim.lr=0.003",
            "rewards.isolate=false",
            "trainer.lora.target_modules=[q_proj, v_proj]",
            "broadcast.method=filesystem",
            "name=other",
        ],
    )
    assert cfg.trainer.max_steps == 5 and type(cfg.trainer.max_steps) is int
    assert cfg.trainer.optim.lr == 0.003 and type(cfg.trainer.optim.lr) is float
    assert cfg.rewards.isolate is False
    assert cfg.trainer.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.broadcast.method == "filesystem" and cfg.name == "other"
    # the rest is untouched
    assert cfg.trainer.batch_size == 128 and cfg.packer.max_off_policy_steps == 2


def test_later_override_wins_and_changes_derived_value():
    cfg = load_config(None, ["trainer.batch_size=16", "producers.group_size=4", "trainer.batch_size=32"])
    assert cfg.trainer.batch_size == 32 and cfg.prompts_per_step == 32 // 4


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.no_such_key=1", "trainer.no_such_key"),
        ("trainer.optim.momentum=0.9", "trainer.optim.momentum"),
        ("bogus=1", "bogus"),
    ],
)
def test_unknown_key_names_dotted_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value) and "unknown key" in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.max_steps=0", "trainer.max_steps"),  # ge=1
        ("trainer.max_steps=many", "trainer.max_steps"),  # not an int
        ("trainer.optim.lr=2.0", "trainer.optim.lr"),  # le=1
        ("broadcast.method=carrier_pigeon", "broadcast.method"),  # not in the Literal
        ("packer.micro_batch_tokens=8", "packer.micro_batch_tokens"),  # ge=16
    ],
)
def test_bad_value_names_dotted_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)
    assert repr(yaml.safe_load(override.partition("=")[2])) in str(err.value)  # shows what it got


def test_batch_size_not_multiple_of_group_size():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.batch_size=20", "producers.group_size=8"])
    msg = str(err.value)
    assert "trainer.batch_size (20)" in msg and "producers.group_size (8)" in msg


def test_async_level_above_off_policy_bound_errors():
    with pytest.raises(ConfigError, match="max_async_level"):
        load_config(None, ["max_async_level=3", "packer.max_off_policy_steps=2"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.gpus=[0]", "trainer.data_parallel=2"], r"trainer:.*gpus lists 1 devices \[0\] for data_parallel=2"),
        (["trainer.gpus=[1,1]", "trainer.data_parallel=2"], r"trainer:.*distinct device indices"),
        (["trainer.gpus=[0]", "trainer.device=cpu"], r"trainer:.*device: cpu"),
        (
            ["producers.tensor_parallel_size=2"],
            r"producers:.*gpus_per_replica \(1\) must equal tensor_parallel_size \(2\)",
        ),
        (
            ["trainer.parallel=fsdp", "trainer.data_parallel=2", "trainer.lora.enabled=true"],
            r"trainer:.*fsdp does not train LoRA",
        ),
        (
            ["trainer.parallel=fsdp", "trainer.data_parallel=2", "broadcast.noise_scheduler.enabled=true"],
            r"noise_scheduler.*fsdp",
        ),
    ],
)
def test_placement_and_sharding_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(
        None,
        [
            "trainer.gpus=[2,3]",
            "trainer.data_parallel=2",
            "trainer.parallel=fsdp",
            "producers.tensor_parallel_size=2",
            "producers.gpus_per_replica=2",
        ],
    ).trainer.gpus == [2, 3]


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["trainer.max_steps"])
    with pytest.raises(ConfigError, match="'name' is not a section"):
        load_config(None, ["name.sub=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    # ConfigError is a ValueError (one error policy)
    assert issubclass(ConfigError, ValueError)


def test_empty_file_gives_all_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == RunConfig()


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.max_steps=7", "trainer.optim.betas=[0.8, 0.95]", "trainer.lora.enabled=true"])
    text = dump_config(cfg)
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    again = load_config(path)
    assert again == cfg
    assert again.trainer.optim.betas == (0.8, 0.95) and again.trainer.lora.enabled is True
    assert dump_config(again) == text
    assert again != load_config()  # equality really compares values


def _busctl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "busctl", "up", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_busctl_dry_run_prints_resolved_config():
    proc = _busctl("--dry-run", "trainer.max_steps=5", "rewards.replicas=3")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["trainer"]["max_steps"] == 5 and printed["rewards"]["replicas"] == 3
    expected = load_config(None, ["trainer.max_steps=5", "rewards.replicas=3"])
    apply_placement(expected)  # busctl up resolves trainer.device and producers.dtype for this host's devices
    assert RunConfig.model_validate(printed) == expected


def test_busctl_dry_run_with_explicit_config_path():
    proc = _busctl(str(CONFIG_DIR / DEFAULT), "packer.micro_batch_tokens=512", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["packer"]["micro_batch_tokens"] == 512


def test_busctl_bad_key_exits_2_naming_it():
    proc = _busctl("--dry-run", "trainer.max_stepz=5")
    assert proc.returncode == 2
    assert "trainer.max_stepz" in proc.stdout + proc.stderr


def test_configs_validate_without_the_bus():
    """``configs`` is the lowest floor: loading and validating a run (``bus.hosts`` included) imports
    neither the bus nor zmq; the hosts' keys are checked against ``configs.topic_names``."""
    code = (
        "import sys\n"
        "from configs.schema import ConfigError, load_config\n"
        "cfg = load_config(None, ['bus.transport=tcp', 'bus.hosts={batches: 10.0.0.2, rollouts-3: 10.0.0.3}',\n"
        "                         'bus.curve_keys_dir=/nonexistent/keys'])\n"
        "assert cfg.bus.hosts == {'batches': '10.0.0.2', 'rollouts-3': '10.0.0.3'}\n"
        "try:\n"
        "    load_config(None, ['bus.hosts={rollouts: x}'])\n"
        "except ConfigError as err:\n"
        "    assert 'rollouts-I' in str(err)\n"
        "else:\n"
        "    raise AssertionError('rollouts without an index was accepted')\n"
        "loaded = sorted(m for m in sys.modules if m == 'zmq' or m.startswith(('zmq.', 'bus.')) or m == 'bus')\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
