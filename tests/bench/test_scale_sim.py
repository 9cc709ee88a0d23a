"""bench.scale's simulation end to end: a 4x4 point through the real hub, prompt source, packer
and bus (real processes, real sockets), with simulated producers, reward workers and trainer.

Every issued prompt must be accounted for (trained, or dropped with a reason) in the prompt
source's ledger, none left unresolved, and no sample trained twice; the per-hop measurements the
sweep reports must be present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.scale_point import run_point
from bench.scale_sim import SimSpec
from bench.scale_stats import summarize
from tests.socket_dirs import remove_outside_socket_dir

SPEC = SimSpec(
    group_size=8,
    median_tokens=32,
    sigma=0.5,
    max_tokens=128,
    prompt_tokens=16,
    tokens_per_s=20_000.0,
    score_s=0.005,
    step_s=0.02,
)


def test_four_by_four_point_accounts_for_every_prompt(tmp_path: Path) -> None:
    run_dir = tmp_path / "point"
    kwargs = dict(producers=4, rewards=4, spec=SPEC, max_steps=3, prompts_per_step=8)
    try:
        raw = run_point(run_dir, timeout_s=240, **kwargs)
        s = summarize(run_dir, raw, message_bytes=1024, **kwargs)
    finally:
        remove_outside_socket_dir(run_dir)
    assert raw["finished"], "the simulated trainer did not finish its 3 steps (see the point's logs)"
    acc = s["accounting"]
    ledger = json.loads((run_dir / "accounting.json").read_text())
    assert acc["issued"] >= 3 * 8
    assert sum(acc["outcomes"].values()) == acc["issued"], acc
    assert acc["unresolved"] == 0 and not ledger["unresolved"]
    assert acc["duplicates_trained"] == 0
    assert acc["outcomes"]["trained"] == acc["trained_groups_seen_by_trainer"] == 3 * 8
    assert acc["complete"]
    # every hop was measured, and each of the 4 + 4 + 1 workers heard every trainer.step
    assert s["rate_groups_s"]["rollouts"] > 0 and s["rate_groups_s"]["scored"] > 0
    assert not math.isnan(s["latency"]["rollouts"]["p99_ms"]) and not math.isnan(s["latency"]["packer"]["p50_ms"])
    assert s["fanout_receipts"] >= 9 * 2  # steps 1 and 2 reach everyone; the last may race run.done
    assert set(s["rss_max_mib"]) == {"hub", "prompt-source", "packer", "sim-trainer", "sim-rewards", "sim-producers"}
