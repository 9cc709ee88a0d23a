"""``busctl up`` as a user runs it (a subprocess, the shipped configs): it never deletes a run it did
not make (:mod:`busctl.run_dir`), config errors exit 2 with one message on stderr naming the file
or override (:mod:`configs.errors`), and ``--dry-run`` refuses what ``up`` refuses before spawning
(:mod:`busctl.preflight`). A real first run's directory is refused in
``tests/e2e/test_pipeline.py::test_pipeline_trains_every_sample_once``; here the previous run is
the files a run leaves (its config from ``--dry-run``, status, checkpoint, metrics, logs)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from busctl.evaluate import eval_config
from busctl.run_dir import inspect_run_dir, overwrite
from configs.schema import dump_config

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def busctl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="300")
    return subprocess.run(
        [sys.executable, "-m", "busctl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def files(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    """A run directory as a finished 300-step run leaves it (its config.yaml is what busctl up resolves)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dry = busctl("up", "--dry-run", f"run_dir={run_dir}", "trainer.max_steps=300")
    assert dry.returncode == 0, dry.stderr
    (run_dir / "config.yaml").write_text(dry.stdout)
    (run_dir / "status.json").write_text(
        json.dumps({"state": "stopped", "outcome": "done", "step": 300, "max_steps": 300})
    )
    for step in (200, 300):
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(os.urandom(256))
        (ckpt / "DONE").write_text("")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(1, 301)))
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "trainer.log").write_text("step 300/300\n")
    return run_dir


def test_second_up_refuses_an_occupied_run_dir_and_keeps_every_file(finished_run: Path) -> None:
    before = files(finished_run)
    second = busctl("up", f"run_dir={finished_run}", "trainer.max_steps=20")
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stdout == ""  # the message is on stderr
    err = second.stderr
    assert f"run_dir {finished_run} holds another run's outputs" in err
    assert "last run: done at step 300/300" in err and "checkpoints/: 2 (step_000200, step_000300)" in err
    assert "metrics.jsonl: 300 lines" in err
    assert f"busctl up --resume {finished_run}" in err  # the three ways on
    assert f"busctl up trainer.max_steps=20 run_dir={finished_run}-2" in err
    assert f"busctl up run_dir={finished_run} trainer.max_steps=20 --overwrite" in err
    assert files(finished_run) == before
    # --dry-run prints the config (stdout stays YAML), warns on stderr, and touches nothing
    dry = busctl("up", "--dry-run", f"run_dir={finished_run}", "trainer.max_steps=20")
    assert dry.returncode == 0 and "max_steps: 20" in dry.stdout
    assert "warning: busctl up would refuse this run" in dry.stderr and "--overwrite" in dry.stderr
    # a refusal that comes after the run-dir check but before the start deletes nothing either
    slurm = busctl("up", "--overwrite", "--launcher", "slurm", f"run_dir={finished_run}")
    assert slurm.returncode == 2 and "inside a Slurm allocation" in slurm.stderr, slurm.stderr
    assert busctl("up", "--resume", str(finished_run), "--overwrite").returncode == 2
    sbatch = busctl("sbatch", f"run_dir={finished_run}")
    assert sbatch.returncode == 2 and "holds another run's outputs" in sbatch.stderr and sbatch.stdout == ""
    sbatch = busctl("sbatch", "--overwrite", f"run_dir={finished_run}")  # the job's busctl up will overwrite, said now
    assert sbatch.returncode == 0 and " up --launcher slurm --overwrite " in sbatch.stdout, (
        sbatch.stdout + sbatch.stderr
    )
    assert "the job's busctl up --overwrite will delete the previous run" in sbatch.stderr
    assert files(finished_run) == before


def test_overwrite_says_what_it_deletes_then_starts_afresh(finished_run: Path, tmp_path: Path) -> None:
    """``--overwrite``: the old run's entries are named on stdout, then gone, and a new run is
    prepared there (interrupted once it is: starting its components is not what is tested)."""
    model = tmp_path / "model"  # model checks pass; no component gets to load it
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    dry = busctl("up", "--dry-run", "--overwrite", f"run_dir={finished_run}", f"model.path={model}")
    assert dry.returncode == 0 and "busctl up --overwrite would delete the previous run" in dry.stderr
    assert (finished_run / "checkpoints" / "step_000300" / "DONE").is_file()  # --dry-run deletes nothing
    up = subprocess.Popen(
        [sys.executable, "-m", "busctl", "up", "--overwrite", f"run_dir={finished_run}", f"model.path={model}"],
        cwd=REPO,
        env=dict(os.environ, NO_COLOR="1", COLUMNS="300"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = []
    try:
        for line in up.stdout:
            out.append(line)
            if line.startswith("run directory:"):  # prepared: the new config.yaml is written
                up.send_signal(signal.SIGINT)
        assert up.wait(timeout=TIMEOUT_S) == 130, "".join(out)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    said = "".join(out)
    assert said.startswith(
        f"--overwrite: deleting the previous run in {finished_run}: checkpoints/, config.yaml, logs/, "
        "metrics.jsonl, status.json; last run: done at step 300/300"
    ), said
    assert not (finished_run / "checkpoints").exists() and not (finished_run / "metrics.jsonl").exists()
    assert f"path: {model}" in (finished_run / "config.yaml").read_text()  # the new run's config


def test_busctl_eval_replaces_only_a_previous_eval(finished_run: Path, tmp_path: Path) -> None:
    """``busctl eval --run-dir`` pointed at a training run deletes nothing (exit 2); a previous eval's
    directory is named, then replaced (the new eval interrupted once prepared)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    before = files(finished_run)
    refused = busctl("eval", f"model.path={model}", "--run-dir", str(finished_run))
    assert refused.returncode == 2 and "holds something other than a previous eval" in refused.stderr, refused.stderr
    assert "last run: done at step 300/300" in refused.stderr and refused.stdout == ""
    assert files(finished_run) == before
    previous = tmp_path / "previous-eval"
    previous.mkdir()
    (previous / "config.yaml").write_text(
        dump_config(eval_config(None, [f"model.path={model}"], str(previous)))
    )  # as busctl eval saves it
    (previous / "eval.jsonl").write_text('{"step": 0, "eval/reverse_text/reward_mean": 0.5}\n')
    ev = subprocess.Popen(
        [sys.executable, "-m", "busctl", "eval", f"model.path={model}", "--run-dir", str(previous)],
        cwd=REPO,
        env=dict(os.environ, NO_COLOR="1", COLUMNS="300"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = []
    try:
        for line in ev.stdout:
            out.append(line)
            if line.startswith("run directory:"):
                ev.send_signal(signal.SIGINT)
        assert ev.wait(timeout=TIMEOUT_S) == 130, "".join(out)
    finally:
        if ev.poll() is None:
            os.killpg(ev.pid, signal.SIGKILL)
    assert out[0].startswith(
        f"busctl eval replaces its previous eval: deleting the previous run in {previous}: config.yaml, eval.jsonl"
    ), out
    assert not (previous / "eval.jsonl").exists()  # the old result is gone; the interrupted eval wrote none
    assert f"path: {model}" in (previous / "config.yaml").read_text()  # the new eval's config


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    up = busctl("up", "--overwrite", f"run_dir={tmp_path}")
    assert up.returncode == 2 and "holds no rlbus run" in up.stderr and "not even with --overwrite" in up.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "data").is_dir()
    occupant = inspect_run_dir(tmp_path)
    with pytest.raises(ValueError, match="holds no rlbus run"):
        overwrite(occupant, print)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]
    # an empty directory and a missing one are free; leftovers of a start that failed early are a run's
    assert inspect_run_dir(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert inspect_run_dir(tmp_path / "empty") is None
    (tmp_path / "early" / "logs").mkdir(parents=True)
    (tmp_path / "early" / "sock").mkdir()
    assert inspect_run_dir(tmp_path / "early").is_run


@pytest.mark.parametrize(
    "args, expected",
    [
        (["trainer.max_steps=[1"], "override 'trainer.max_steps=[1': the value '[1' is not valid YAML at column 3"),
        (
            ["trainer.max_step=3"],
            "trainer.max_step: unknown key (override 'trainer.max_step=3'); did you mean trainer.max_steps?",
        ),
        (["trainer.max_steps"], "write trainer.max_steps=VALUE"),
        (
            ["task.name=gsm9k"],
            "known tasks: reverse_text, gsm8k, countdown, reverse_turns, gsm8k_calculator, prompt_file, or an "
            "import path 'package.module:function'; did you mean 'gsm8k'?",
        ),
        (
            ["task.rewards=[{name: revrse_text}]"],
            "task.rewards: unknown reward name='revrse_text'; known: countdown, gsm8k, "
            "reverse_text, or an import path 'package.module:function'; did you mean 'reverse_text'?",
        ),
        (["model.path=nobody-org/no-such-model"], "model.path='nobody-org/no-such-model' is not available offline"),
        (["task.rewards=[{name: 'tasks.reverse_text:nothing_here'}]"], "has no attribute 'nothing_here'"),
        (["eval.only=true"], "eval.only=true is busctl eval's mode, not a training run: run `busctl eval"),
    ],
)
def test_config_errors_exit_2_on_stderr_for_up_and_dry_run(args: list[str], expected: str, tmp_path: Path) -> None:
    for dry in ([], ["--dry-run"]):
        proc = busctl("up", *dry, f"run_dir={tmp_path / 'run'}", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr
        assert expected in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_yaml_syntax_error_in_a_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 3\n   batch_size: 8\n")
    proc = busctl("up", "--dry-run", str(bad))
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert f"config file {bad}, line 3, column 14: not valid YAML" in proc.stderr, proc.stderr


def test_help_is_plain_text() -> None:
    """``busctl --help`` and each command's help show no reStructuredText markup."""
    for args in (["--help"], ["up", "--help"], ["sbatch", "--help"]):
        proc = busctl(*args)
        assert proc.returncode == 0, proc.stderr
        assert "``" not in proc.stdout and ":mod:" not in proc.stdout and ":func:" not in proc.stdout, proc.stdout
    text = busctl("--help").stdout
    assert "busctl up [CONFIG] [key.sub=value ...]" in text and "--overwrite" in text
