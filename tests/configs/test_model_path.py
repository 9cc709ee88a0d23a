"""configs.model_path: ``model.path`` as a directory or a hub id resolved from a real HF cache layout
(``models--org--name/refs/main`` + ``snapshots/<commit>/``) built in a temporary ``HF_HOME``, offline;
the loaders (trainer, vLLM engine, teacher) and ``busctl up`` go through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs.model_path import hf_hub_cache, resolve_model_path, resolve_run_model_paths
from configs.schema import LoraSection, load_config
from trainer.state.model import load_policy
from policies.model_families import build_family_model

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, the hub cache variables that would win over it unset, offline."""
    for var in ("HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def cache_model(hf_home: Path, repo: str, commit: str = COMMIT, *, ref: str | None = "main") -> Path:
    """A tiny Qwen2.5 saved where huggingface_hub puts a download of ``repo`` at ``commit``."""
    repo_dir = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = build_family_model(repo_dir / "snapshots" / commit, "qwen2.5", tied=True)
    if ref is not None:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


def test_hub_cache_follows_huggingface_hub_order(hf_home, monkeypatch):
    assert hf_hub_cache() == hf_home / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", "/somewhere/else")
    assert hf_hub_cache() == Path("/somewhere/else")


def test_a_directory_resolves_to_itself(tmp_path, hf_home, monkeypatch):
    model = build_family_model(tmp_path / "m", "qwen3", tied=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("m") == str(model.resolve())
    assert resolve_model_path(model) == str(model.resolve())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"model.path='empty'.*no config.json"):
        resolve_model_path("empty")


def test_a_hub_id_resolves_to_its_cached_snapshot(hf_home):
    snapshot = cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct")
    cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct", OTHER, ref="v2")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == str(snapshot.resolve())
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct@v2").endswith(f"/snapshots/{OTHER}")
    assert resolve_model_path(f"Qwen/Qwen2.5-0.5B-Instruct@{COMMIT}") == str(snapshot.resolve())


def test_a_missing_hub_id_names_the_key_and_where_it_looked(hf_home):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("meta-llama/Meta-Llama-3-8B-Instruct", key="teacher.model_path")
    text = str(err.value)
    assert "teacher.model_path='meta-llama/Meta-Llama-3-8B-Instruct'" in text
    assert str(hf_home / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct" / "refs" / "main") in text
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_model_path("./no/such/dir")
    with pytest.raises(ValueError, match="model.path is empty"):
        resolve_model_path(" ")


def test_a_ref_without_its_snapshot_is_not_found(hf_home):
    repo_dir = hf_home / "hub" / "models--Qwen--Qwen3-0.6B"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)  # an interrupted download: no snapshot
    with pytest.raises(FileNotFoundError, match=f"snapshot .*{COMMIT}"):
        resolve_model_path("Qwen/Qwen3-0.6B")


def test_the_trainer_loads_a_hub_id_from_the_cache(hf_home):
    snapshot = cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct")
    model = load_policy("Qwen/Qwen2.5-0.5B-Instruct", LoraSection())
    assert type(model).__name__ == "Qwen2ForCausalLM"
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))


def test_run_config_paths_are_resolved_in_place(hf_home):
    snapshot = cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct")
    cfg = load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "teacher.model_path=Qwen/Qwen2.5-0.5B-Instruct"])
    resolve_run_model_paths(cfg)
    assert cfg.model.path == cfg.teacher.model_path == str(snapshot.resolve())
    empty = load_config(None, [])
    resolve_run_model_paths(empty)  # the tiny policy is built later by busctl up
    assert empty.model.path == "" and empty.teacher.model_path == ""


def test_busctl_up_refuses_a_model_that_is_not_cached(tmp_path, hf_home):
    proc = subprocess.run(
        [sys.executable, "-m", "busctl", "up", f"run_dir={tmp_path / 'run'}", "model.path=Qwen/Qwen2.5-7B-Instruct"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert "model.path='Qwen/Qwen2.5-7B-Instruct'" in out and "models--Qwen--Qwen2.5-7B-Instruct" in out
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_the_vllm_engine_and_the_teacher_resolve_hub_ids(hf_home):
    """Construction only (no engine start): the path vLLM will load is the snapshot; errors name the key."""
    pytest.importorskip("vllm", reason="producers.engine needs vLLM at start only, but its tests run where it is")
    from producers.engine import RolloutEngine
    from producers.teacher import Teacher

    snapshot = cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct")
    assert RolloutEngine("Qwen/Qwen2.5-0.5B-Instruct").model_path == str(snapshot.resolve())
    teacher = Teacher("Qwen/Qwen2.5-0.5B-Instruct", max_model_len=64, kv_cache_bytes=2**20)
    assert teacher.engine.model_path == str(snapshot.resolve())
    with pytest.raises(FileNotFoundError, match="teacher.model_path='Qwen/Qwen3-8B'"):
        Teacher("Qwen/Qwen3-8B", max_model_len=64, kv_cache_bytes=2**20)


def test_a_policy_without_a_chat_template_is_refused_before_start(tmp_path, hf_home):
    """The producers render every prompt with the chat template: a base checkpoint without one would
    fail every group (and its replacements) forever, so busctl up refuses it, naming the key."""
    model = build_family_model(tmp_path / "base", "llama3", tied=False)
    cfg = load_config(None, [f"model.path={model}"])
    resolve_run_model_paths(cfg)  # has a template: accepted
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = model / name
        if path.is_file() and name == "chat_template.jinja":
            path.unlink()
        elif path.is_file():
            data = json.loads(path.read_text())
            data.pop("chat_template", None)
            path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"model.path=.*no chat template"):
        resolve_run_model_paths(load_config(None, [f"model.path={model}"]))
    proc = subprocess.run(
        [sys.executable, "-m", "busctl", "up", f"run_dir={tmp_path / 'run'}", f"model.path={model}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no chat template" in " ".join((proc.stdout + proc.stderr).split())
