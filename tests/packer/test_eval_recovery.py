"""A packer stopped and restarted in the middle of an eval round (a real PackerProc on a real
control hub and real couriers; the restart rebuilds from ``RUN_DIR/packer/eval.bin``): the round's
result is published once from the new packer and equals what the same groups give without a
restart; a restart after the round closed, a late group of the round, a trainer whose version goes
back and a control hub restart each make it publish the stored result again (the same messages),
and a resumed packer forgets rounds above the checkpoint step. Its eval.jsonl holds each (round,
task) once through all of it, the records of a round closed before a crash that cut the file short
included, and a resume cuts it back to the checkpoint's rounds."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path


from bus.hub import ControlHub
from bus.messages import EvalResult, GroupsDropped, WeightsReady, new_id
from packer.evaluation import EvalAggregator
from runfiles.eval_records import EVAL_FILE, eval_record
from tests.packer.test_packer_proc import WAIT_S, eval_group, start_packer, stop_packer, wait_until

pytest_plugins = ["tests.packer.test_packer_proc"]  # the ``live`` fixture

GROUPS = [
    eval_group(2, "reverse_text", 0, [1, 0], 4),
    eval_group(2, "reverse_text", 1, [0, 0], 4),
    eval_group(2, "countdown", 0, [1, 1], 4),
]
FAILED = "e000002-countdown-00001"
WEIGHTS = WeightsReady(id="w", version=0, method="filesystem", manifest=[], path="", num_bytes=0)


def results_of(live, until: int) -> list[EvalResult]:
    """Eval results announced on the control channel until ``until`` arrived (or the wait ends)."""
    got: list[EvalResult] = []
    wait_until(
        lambda: (
            got.extend(m for m in live.announcements(quiet_s=0.1) if isinstance(m, EvalResult)) or len(got) >= until
        ),
        f"{until} eval results",
    )
    got.extend(m for m in live.announcements(quiet_s=0.5) if isinstance(m, EvalResult))  # and nothing more
    return got


def eval_lines(live) -> list[dict]:
    """The packer's eval.jsonl records, in file order."""
    path = Path(live.cfg.run_dir) / EVAL_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def key(r: EvalResult) -> tuple:
    return (
        r.round,
        r.task,
        r.num_samples,
        r.num_failed,
        r.version_min,
        r.version_max,
        tuple(sorted(r.metrics.items())),
    )


def test_a_round_cut_by_a_packer_restart_is_reported_once_and_as_without_it(live):
    expected = EvalAggregator()
    for g in GROUPS:
        expected.add(g)
    (no_restart,) = expected.add_failed([FAILED])

    worker = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    proc, thread = start_packer(live)
    for g in GROUPS[:2]:
        assert worker.send(g, timeout_s=WAIT_S)
    wait_until(lambda: worker.unfinished() == 0, "two groups in the eval spool, released upstream")
    failed = GroupsDropped(id=new_id(), group_ids=[FAILED], reason="failed: generation")

    def counted() -> bool:
        live.pub.send(failed)  # the producer's report; repeated until the packer's SUB has joined
        return FAILED in proc.evaluation.rounds[2].failed

    wait_until(counted, "the failure counted")
    stop_packer(proc, thread)  # the round (3 of 4 groups in) now lives only in the eval spool

    proc, thread = start_packer(live)
    assert sorted(proc.evaluation.rounds[2].received) == sorted(g.id for g in GROUPS[:2])
    assert worker.send(GROUPS[0], timeout_s=WAIT_S)  # a re-send of a group from before the restart: counted once
    assert worker.send(GROUPS[2], timeout_s=WAIT_S)
    got = results_of(live, 2)
    assert sorted(map(key, got)) == sorted(map(key, no_restart.results)) and len(got) == 2
    records = sorted((eval_record(r) for r in no_restart.results), key=lambda r: sorted(r))
    assert sorted(eval_lines(live), key=lambda r: sorted(r)) == records  # written before published
    stop_packer(proc, thread)
    path = Path(live.cfg.run_dir) / EVAL_FILE  # as if the packer died writing the round's second line
    path.write_text(path.read_text().split("\n")[0] + "\n" + path.read_text().split("\n")[1][:25])

    proc, thread = start_packer(live)  # closed before this restart: the same results published again
    assert 2 in proc.evaluation.closed and proc.evaluation.rounds == {}
    again = results_of(live, 2)  # re-sent at start and at each re-announce delay: the same messages
    assert {key(r): r.id for r in again} == {key(r): r.id for r in got}
    wait_until(lambda: not proc._republish_at, "the start's re-publications done")
    live.announcements(quiet_s=0.5)
    assert worker.send(GROUPS[1], timeout_s=WAIT_S)  # the round issued again by a restarted prompt source
    late = results_of(live, 2)  # answered with the stored results once more
    assert {key(r): r.id for r in late} == {key(r): r.id for r in got} and len(late) == 2
    wait_until(lambda: worker.unfinished() == 0, "the late group released")
    # the trainer restarted from a checkpoint (its weights.ready goes back): published once more
    for version in (5, 3):
        assert live.pub.send(dataclasses.replace(WEIGHTS, id=f"w-{version}", version=version))
    wait_until(lambda: proc._trainer_version == 3, "both weights.ready seen")
    assert {key(r): r.id for r in results_of(live, 2)} == {key(r): r.id for r in got}
    stop_packer(proc, thread)
    assert sorted(eval_lines(live), key=lambda r: sorted(r)) == records  # each once: written again from the spool


def test_a_resumed_packer_forgets_rounds_above_the_checkpoint(live, monkeypatch):
    worker = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    proc, thread = start_packer(live)
    rounds = [(1, 0, 1), (3, 0, 2), (4, 0, 1)]  # (round, group, groups in the round)
    for rnd, i, size in rounds:
        assert worker.send(eval_group(rnd, "reverse_text", i, [0, 1], size), timeout_s=WAIT_S)
    assert len(results_of(live, 2)) == 2  # rounds 1 and 4 closed, round 3 open
    assert sorted(r["step"] for r in eval_lines(live)) == [1, 4]
    stop_packer(proc, thread)
    done = Path(live.cfg.run_dir) / "checkpoints" / "step_000002" / "DONE"
    done.parent.mkdir(parents=True)
    done.write_text("")
    monkeypatch.setenv("RLBUS_RESUME", "1")
    proc, thread = start_packer(live)
    assert (proc.evaluation.closed, proc.evaluation.rounds) == ({1}, {})
    assert {r.round for r in results_of(live, 1)} == {1}
    assert [r["step"] for r in eval_lines(live)] == [1]  # round 4 evaluated the lost lineage
    stop_packer(proc, thread)


def test_results_are_published_again_after_a_control_hub_restart(live):
    worker = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    proc, thread = start_packer(live)
    assert worker.send(eval_group(1, "reverse_text", 0, [1, 1], 1), timeout_s=WAIT_S)
    (first,) = results_of(live, 1)
    live.stop.set()  # the hub goes down (a result published now would be lost) and comes back
    live.hub_thread.join(timeout=WAIT_S)
    live.hub.inbound.close()
    live.hub.outbound.close()
    live.stop = threading.Event()
    live.hub = ControlHub(
        live.ctx, live.endpoints.address("control_pub"), live.endpoints.address("control_sub"), live.stop
    )
    live.hub_thread = threading.Thread(target=live.hub.run, daemon=True)
    live.hub_thread.start()
    wait_until(lambda: proc.control_out.reconnects >= 1, "the packer reconnected to the new hub")
    assert {r.id for r in results_of(live, 1)} == {first.id}
    stop_packer(proc, thread)
