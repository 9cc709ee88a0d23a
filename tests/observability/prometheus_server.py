"""Test helper: a real Prometheus server (the Debian ``prometheus`` binary) on a free local port.

:func:`prometheus_binary` finds ``prometheus`` on PATH, installs the Debian package when it can
(root and apt-get), and otherwise skips the test with the reason. :class:`PrometheusServer` runs
it with its TSDB in a temporary directory, ``--web.enable-lifecycle`` so that a changed config is
applied with :meth:`PrometheusServer.apply`, and queries it over the HTTP API.
:class:`ScrapeConfigFollower` keeps the server's config equal to a run's ``RUN_DIR/prometheus.yml``
(with a 1 s scrape interval) while ``busctl up`` rewrites it as components become ready.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from busctl.components.table import free_port

APT_TIMEOUT_S = 600
"""Longest wait for ``apt-get update && apt-get install prometheus``, seconds."""


def prometheus_binary() -> str:
    """Path of the ``prometheus`` executable; installs the Debian package when missing and this
    process is root with apt-get; otherwise ``pytest.skip`` with the reason."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "prometheus is not on PATH and cannot be installed here (needs root and apt-get): "
            "install it, e.g. `apt-get install prometheus` on Debian/Ubuntu"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = "apt-get update && apt-get install -y --no-install-recommends prometheus"
    done = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
    found = shutil.which("prometheus") or (Path("/usr/bin/prometheus").is_file() and "/usr/bin/prometheus")
    if done.returncode != 0 or not found:
        pytest.skip(f"installing the Debian prometheus package failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return found


class PrometheusError(RuntimeError):
    """Prometheus refused a request (bad PromQL, bad config) or did not answer."""


class PrometheusServer:
    """One ``prometheus`` process on ``127.0.0.1:<free port>`` with its data under ``workdir``.

    Args:
        binary: the ``prometheus`` executable.
        workdir: directory for the config file (``prometheus.yml``), TSDB and log.
        config: initial configuration (a dict written as YAML); default: no scrape jobs.

    Raises:
        PrometheusError: it did not become ready within 60 s (the log tail is in the message).
    """

    def __init__(self, binary: str, workdir: Path, config: dict | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config or {"scrape_configs": []}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def apply(self, config: dict) -> None:
        """Write ``config`` and make the server load it (``POST /-/reload``).

        Raises:
            PrometheusError: the server rejected the configuration.
        """
        self.config_path.write_text(yaml.safe_dump(config))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"reload failed: {exc.read().decode(errors='replace')}") from exc

    def api(self, path: str, **params: str | float) -> dict:
        """GET ``/api/v1/<path>`` with ``params``; returns the ``data`` field.

        Raises:
            PrometheusError: HTTP or PromQL error, with Prometheus's message.
        """
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """The series of ``expr`` evaluated every ``step_s`` seconds over ``[start, end]`` (unix
        time, seconds): ``[{"metric": {labels}, "values": [[t, "value"], ...]}, ...]``."""
        return self.api("query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def active_targets(self) -> list[dict]:
        """``/api/v1/targets`` active targets: ``scrapeUrl``, ``health`` (up/down/unknown), ``labels``."""
        return self.api("targets", state="active")["activeTargets"]

    def stop(self) -> None:
        """Terminate the server (kill after 10 s); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def fast_scrape_config(run_config: dict, interval: str = "1s") -> dict:
    """A run's scrape config (parsed ``prometheus.yml``) with every job scraped every ``interval``."""
    config = json.loads(json.dumps(run_config or {}))  # a deep copy of plain YAML data
    config["global"] = {**config.get("global", {}), "scrape_interval": interval, "scrape_timeout": interval}
    for job in config.get("scrape_configs") or []:
        job["scrape_interval"] = interval
        job.pop("scrape_timeout", None)
    return config


def static_targets(config: dict) -> set[str]:
    """Every ``host:port`` in the static_configs of ``config``'s scrape jobs."""
    return {
        t
        for job in config.get("scrape_configs") or []
        for sc in job.get("static_configs") or []
        for t in sc.get("targets") or []
    }


class ScrapeConfigFollower:
    """Applies ``run_config_path`` (``RUN_DIR/prometheus.yml``, scraped every second) to
    ``server`` whenever the file changes, from a daemon thread, until :meth:`close`.

    Attributes:
        applied: the last run config applied (parsed YAML), None before the file exists.
        error: why the last change could not be applied (retried every poll), re-raised by :meth:`close`.
    """

    def __init__(self, server: PrometheusServer, run_config_path: Path, poll_s: float = 0.2) -> None:
        self.server, self.path, self.poll_s = server, Path(run_config_path), poll_s
        self.applied: dict | None = None
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scrape-config-follower", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        last_text = None
        while not self._stop.wait(self.poll_s):
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                continue
            if text == last_text:
                continue
            try:
                config = yaml.safe_load(text)
                self.server.apply(fast_scrape_config(config))
            except Exception as exc:
                self.error = exc
                continue
            last_text, self.applied, self.error = text, config, None

    def close(self) -> None:
        """Stop following.

        Raises:
            Exception: the run's last config could not be applied.
        """
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
