"""Fixtures shared by every test package; ``--quick``; the grouping of test files for pytest-xdist.

``metric(name, **labels)`` reads a sample of this test process's default Prometheus registry (0 if never set).
A heavy test file starts vLLM, whole pipeline runs or a cluster (Slurm, Ray, network namespaces):
:data:`HEAVY_USES` names what such a file's source contains. ``--quick`` (``make test-quick``) leaves heavy
files out without importing them; ``--heavy`` runs only those. Under ``pytest -n 2 --dist loadgroup`` each file
runs whole on one worker (module fixtures set up once); one worker takes the files that start pipelines or
clusters (:data:`PIPELINE_USES`) first, the other the light files, until its kind runs out.
This process runs torch on one thread (:func:`producers.vllm_procs.pin_torch_to_one_thread`), so the vLLM engines
the tests build fork their EngineCore instead of spawning one that imports torch and vLLM again (~14 s each).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import pytest
from prometheus_client import REGISTRY

from producers.vllm_procs import pin_torch_to_one_thread

pin_torch_to_one_thread()  # before any test's torch work

PIPELINE_USES = (
    "pytest.mark.e2e",  # a whole `busctl up` pipeline run with vLLM (the marker's meaning)
    "slurm_cluster",
    "ray_cluster",
    "netns_pair",
    "torchrun",  # several trainer processes
)
HEAVY_USES = (
    *PIPELINE_USES,
    '"busctl", "up"',  # a `busctl up` subprocess (a dry run takes seconds)
    'importorskip("vllm"',  # a vLLM engine (every test file that starts one asks for it this way)
    'find_spec("vllm")',  # a `vllm serve` server (tests/producers/test_server_engine.py)
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="skip test files that start vLLM, pipelines or clusters")
    parser.addoption("--heavy", action="store_true", help="only the test files --quick skips (make test runs both)")


@functools.cache
def uses(path: Path, kinds: tuple[str, ...]) -> bool:
    """Whether the source of the test file at ``path`` contains anything of ``kinds``."""
    return any(use in path.read_text() for use in kinds)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``--quick``, ignore a heavy ``test_*.py`` file; with ``--heavy``, every other one."""
    quick, heavy = config.getoption("--quick"), config.getoption("--heavy")
    if quick and heavy:
        raise pytest.UsageError("--quick and --heavy exclude each other")
    if not (quick or heavy) or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    return True if uses(collection_path, HEAVY_USES) == quick else None


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadgroup``: each file is one work unit; worker gw0 takes the files that start pipelines or
    clusters (:data:`PIPELINE_USES`) first, the others the remaining files first, and a worker whose kind has run
    out takes the other kind. So pipelines mostly run one at a time beside the light files, and no worker idles.
    (A scheduler is xdist's hook for this; its ``xdist_group`` marks do not reach the node ids under pytest 9.2.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class PipelinesOnGw0(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            wants_pipelines = node.gateway.id == "gw0"
            scope = next((s for s in self.workqueue if uses(root / s, PIPELINE_USES) == wants_pipelines), None)
            if scope is not None:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return PipelinesOnGw0(config, log)


def sample(name: str, **labels: str) -> float:
    """Current value of a sample in the default Prometheus registry (0 if never set)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def metric() -> Callable[..., float]:
    """:func:`sample`, as a fixture."""
    return sample


@pytest.fixture(scope="session")
def recorded_pipeline_run(tmp_path_factory: pytest.TempPathFactory):
    """One finished 4-step ``busctl up`` (``tests.e2e.test_pipeline``'s settings: async level 1, 2 steps of
    off-policy lag allowed, every step's samples kept, a TensorBoard tracker) shared by the test files that
    assert on a plain finished run: ``(run_dir, console output, control messages heard)``."""
    from policies.tiny_model import build_random_policy
    from tests.e2e.test_pipeline import GROUP_SIZE, MAX_STEPS, run_recorded

    policy = build_random_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0)
    run_dir = tmp_path_factory.mktemp("pipeline") / "run"
    out, messages = run_recorded(
        run_dir,
        policy,
        f"trainer.max_steps={MAX_STEPS}",
        "max_async_level=1",
        "packer.max_off_policy_steps=2",
        "report.samples_interval=1",
        f"report.samples_per_step={2 * GROUP_SIZE}",
        "report.trackers=[tensorboard]",
    )
    return run_dir, out, messages, policy
