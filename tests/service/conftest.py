"""One ``busctl serve`` per test module (CI time: its trainer takes ~10-40 s to start, a sampler's vLLM more), on
a tiny random policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.observability.conftest import prometheus_bin  # noqa: F401  (a fixture: the Prometheus binary)

API_KEY = "tml-rlbus-test-key"


@dataclass
class Served:
    """A running ``busctl serve``: its ``url``, run directory and the tiny policy it serves."""

    url: str
    run_dir: Path
    policy: Path
    proc: subprocess.Popen


def start_serve(tmp: Path, policy: Path, *overrides: str, timeout_s: float = 420.0) -> Served:
    """Start ``busctl serve`` in ``tmp/run`` and wait until every component is ready."""
    run_dir = tmp / "run"
    env = {**os.environ, "RLBUS_SERVE_API_KEYS": f"{API_KEY},tml-second-key"}
    cmd = [sys.executable, "-m", "busctl", "serve", f"run_dir={run_dir}", f"model.path={policy}", "serve.port=0"]
    log = open(tmp / "busctl-serve.log", "w")
    proc = subprocess.Popen([*cmd, *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"busctl serve exited {proc.returncode}: {(tmp / 'busctl-serve.log').read_text()}")
        if "components ready" in (tmp / "busctl-serve.log").read_text():
            url = json.loads((run_dir / "serve.json").read_text())["url"]
            return Served(url, run_dir, policy, proc)
        time.sleep(0.5)
    stop_serve(Served("", run_dir, policy, proc))
    raise AssertionError(f"busctl serve not ready in {timeout_s} s: {(tmp / 'busctl-serve.log').read_text()}")


def stop_serve(served: Served) -> None:
    """``busctl down``'s way: SIGTERM to busctl serve, which stops its components."""
    if served.proc.poll() is None:
        os.killpg(served.proc.pid, signal.SIGTERM)
        try:
            served.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(served.proc.pid, signal.SIGKILL)
            served.proc.wait()


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The module's ``busctl serve``, with the module's ``SERVE_OVERRIDES`` (default: no sampler, no vLLM)."""
    from policies.tiny_model import build_random_policy

    tmp = tmp_path_factory.mktemp("serve")
    policy = build_random_policy(tmp / "tiny", seed=0)
    s = start_serve(tmp, policy, *getattr(request.module, "SERVE_OVERRIDES", ("serve.samplers=0",)))
    yield s
    stop_serve(s)
