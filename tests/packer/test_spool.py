"""Tests for packer.spool on real files: what is written comes back on reopening (and a planned
step packs into the very same micro-batches), a torn tail is dropped and counted, compaction keeps
only the live state, and a resumed run's packer numbers steps from the trainer's checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from bus.codec import encode
from bus.messages import MicroBatch, ScoredGroup
from packer.packer import Packer
from packer.spool import SPOOL_NAME, Spool, checkpoint_step, trained_group_ids
from runfiles.jsonl import append_jsonl
from trainer.state.checkpoint import DONE, latest_checkpoint


def group(gid: str, seed: int) -> ScoredGroup:
    """Two samples with distinct, seed-dependent tokens, logprobs and rewards."""
    rng = np.random.default_rng(seed)
    lens = np.int32([3 + seed % 3, 4])
    n = int(lens.sum())
    rewards = rng.random(2).astype(np.float32)
    return ScoredGroup(
        id=gid,
        prompt_index=seed,
        step=0,
        task="reverse_text",
        info={"target": gid},
        producer="producer-0",
        completion_texts=["a", "b"],
        finish_reasons=["stop", "stop"],
        gen_time_s=0.0,
        prompt_ids=np.int32([1, 2, seed]),
        completion_ids=rng.integers(10, 100, n).astype(np.int32),
        completion_lens=lens,
        sampler_logprobs=-rng.random(n).astype(np.float32),
        version_start=np.int64([0, 0]),
        version_end=np.int64([0, 0]),
        reward_worker="rewards-0",
        rewards=rewards,
        advantages=rewards - rewards.mean(),
    )


def frames(batches: list[MicroBatch]) -> list[list[bytes]]:
    return [[bytes(f) for f in encode(mb)] for mb in batches]


def test_reopened_spool_has_the_same_state_and_packs_the_same_step(tmp_path):
    groups = [group(f"g{i}", i) for i in range(3)]
    spool = Spool(tmp_path)
    assert not spool.existed and spool.state.next_step == 0
    for g in groups:
        spool.accepted(g)
    spool.planned(0, ["g1", "g0"])
    spool.close()

    again = Spool(tmp_path)
    st = again.state
    assert again.existed and again.torn_records == 0
    assert (st.next_step, st.seen, list(st.buffered), st.steps) == (1, {"g0", "g1", "g2"}, ["g2"], {0: ["g1", "g0"]})
    packer = Packer(2, 1, 32)
    before = packer.pack([groups[1], groups[0]], 0)
    after = packer.pack([st.groups["g1"], st.groups["g0"]], 0)
    assert [mb.id for mb in after] == [mb.id for mb in before] and frames(after) == frames(before)
    with pytest.raises(ValueError, match="next step is 1"):
        again.planned(0, ["g2"])
    with pytest.raises(ValueError, match="not buffered"):
        again.planned(1, ["g0"])
    again.planned(1, ["g2"])
    again.close()
    assert Spool(tmp_path).state.next_step == 2


def test_a_torn_tail_is_dropped_counted_and_appended_over(tmp_path):
    spool = Spool(tmp_path)
    spool.accepted(group("g0", 0))
    spool.accepted(group("g1", 1))
    spool.close()
    path = tmp_path / SPOOL_NAME
    whole = path.stat().st_size
    with open(path, "r+b") as f:  # a crash in the middle of writing g1's record
        f.truncate(whole - 7)

    torn = Spool(tmp_path)
    assert torn.torn_records == 1
    assert list(torn.state.buffered) == ["g0"] and torn.state.seen == {"g0"}
    torn.accepted(group("g2", 2))  # appended where the intact records end
    torn.close()
    healed = Spool(tmp_path)
    assert healed.torn_records == 0 and list(healed.state.buffered) == ["g0", "g2"]
    healed.close()

    with open(path, "r+b") as f:  # a flipped byte inside the last record: its checksum fails
        f.seek(path.stat().st_size - 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert list(Spool(tmp_path).state.buffered) == ["g0"]


def test_compaction_keeps_only_the_live_state(tmp_path):
    spool = Spool(tmp_path, compact_min_bytes=0)
    for i in range(6):
        spool.accepted(group(f"g{i}", i))
    spool.planned(0, ["g0", "g1"])
    spool.planned(1, ["g2", "g3"])
    spool.released(0)
    assert not spool.should_compact()  # dead (2 groups) does not outweigh live (4 groups)
    spool.released(1)
    assert spool.should_compact()
    size = (tmp_path / SPOOL_NAME).stat().st_size
    spool.compact(buffered=["g5"])  # g4 was dropped from the packer's buffer as stale
    assert (tmp_path / SPOOL_NAME).stat().st_size < size / 2
    assert not spool.should_compact()
    spool.planned(2, ["g5"])
    spool.close()

    st = Spool(tmp_path).state
    assert st.seen == {f"g{i}" for i in range(6)}  # the run-wide duplicate guard survives
    assert (st.next_step, list(st.buffered), st.steps, set(st.groups)) == (3, [], {2: ["g5"]}, {"g5"})


def test_released_marks_every_step_up_to_it(tmp_path):
    spool = Spool(tmp_path)
    for i in range(4):
        spool.accepted(group(f"g{i}", i))
    spool.planned(0, ["g0"])
    spool.planned(1, ["g1"])
    spool.planned(2, ["g2"])
    spool.released(1)
    spool.released(0)  # an older repeat (a resumed trainer re-announces): nothing changes
    assert spool.state.steps == {2: ["g2"]} and set(spool.state.groups) == {"g2", "g3"}
    spool.close()
    assert Spool(tmp_path).state.steps == {2: ["g2"]}


def test_a_resumed_spool_numbers_from_the_trainer_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert checkpoint_step(run_dir) == 0
    for step, complete in ((4, True), (2, True), (6, False)):  # step_000006: a save cut short
        d = run_dir / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        if complete:
            (d / DONE).write_text("")
    assert checkpoint_step(run_dir) == 4 == int(latest_checkpoint(run_dir / "checkpoints").name[5:])

    spool = Spool(run_dir / "packer", first_step=checkpoint_step(run_dir))
    assert spool.state.next_step == 4
    with pytest.raises(ValueError, match="next step is 4"):
        spool.planned(0, [])
    spool.close()
    assert Spool(run_dir / "packer").state.next_step == 4  # the start is durable
    with pytest.raises(ValueError, match="first_step"):
        Spool(tmp_path / "other", first_step=-1)


def test_a_resumed_spool_without_its_file_treats_the_lineage_trained_groups_as_duplicates(tmp_path):
    """busctl up --resume with the spool lost: the groups trained in steps below the checkpoint may
    come back (re-issued before the trainer's re-announced groups.trained reached the ledger);
    they must be duplicates, not trained a second time."""
    run_dir = tmp_path / "run"
    assert trained_group_ids(run_dir, 4) == []  # no record yet
    run_dir.mkdir()
    for step in range(6):  # steps 4 and 5 trained after the checkpoint of step 4: the lost lineage
        append_jsonl(
            run_dir / "trained_samples.jsonl",
            {"step": step, "sample_ids": [f"p{step}a/0", f"p{step}a/1", f"p{step}b/0", f"p{step}b/1"]},
        )
    with (run_dir / "trained_samples.jsonl").open("a") as f:
        f.write('{"step": 6, "sample_ids": ["p6a/')  # a line cut short by the crash
    trained = trained_group_ids(run_dir, 4)
    assert trained == [f"p{s}{g}" for s in range(4) for g in "ab"]

    spool = Spool(run_dir / "packer", first_step=4)
    spool.mark_seen(trained)
    spool.mark_seen([])  # nothing to record
    spool.close()
    state = Spool(run_dir / "packer").state  # durable
    assert state.next_step == 4 and state.seen == set(trained) and not state.buffered
    packer = Packer(1, 8, 64)  # version 0 groups at step 4: within the staleness bound
    packer.restore(next_step=state.next_step, seen=state.seen, buffer=[])
    assert packer.add(group("p1a", 1)) == (False, "duplicate")
    assert packer.add(group("p4a", 4)) == (True, "")  # trained only in the lost lineage: trained again


def test_a_burst_of_accepted_groups_shares_one_fsync_and_all_come_back(tmp_path):
    spool = Spool(tmp_path)
    created = spool.log.fsyncs  # the start record
    for i in range(5):
        spool.accepted(group(f"g{i}", i), sync=False)
    assert spool.log.fsyncs == created and spool.log.unsynced
    spool.log.sync()
    spool.log.sync()  # nothing left to make durable: no second fsync
    assert spool.log.fsyncs == created + 1 and not spool.log.unsynced
    spool.accepted(group("g5", 5))  # the default still fsyncs each record
    assert spool.log.fsyncs == created + 2
    spool.close()
    assert list(Spool(tmp_path).state.buffered) == [f"g{i}" for i in range(6)]


def test_a_burst_of_eval_groups_shares_one_fsync_and_replays_into_the_open_round(tmp_path):
    from packer.eval_spool import EvalSpool
    from packer.evaluation import EvalAggregator
    from tests.packer.test_evaluation import eval_group

    agg = EvalAggregator()
    spool = EvalSpool(tmp_path, agg)
    groups = [eval_group(3, "reverse_text", i, [0.5 + i / 10], size=4) for i in range(3)]
    for g in groups:
        assert agg.add(g)[0] == "taken"
        spool.taken(g, sync=False)
    assert spool.log.fsyncs == 0 and spool.log.unsynced
    spool.log.sync()
    assert spool.log.fsyncs == 1 and not spool.log.unsynced
    spool.close()
    replayed = EvalAggregator()
    EvalSpool(tmp_path, replayed).close()
    assert sorted(replayed.rounds[3].received) == sorted(g.id for g in groups)
    closed = replayed.add(eval_group(3, "reverse_text", 3, [0.9], size=4))[1]  # the 4th of 4 closes it
    assert closed is not None and closed.round == 3
