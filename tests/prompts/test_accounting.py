"""Tests for prompts.accounting.Ledger: outcomes, first-wins conflicts, unknown ids, the journal
(rebuild after a kill, a truncated last line, corruption) and accounting.json, on real files."""

from __future__ import annotations

import json

import pytest

from prompts.accounting import ACCOUNTING_NAME, JOURNAL_NAME, OUTCOMES, Ledger, outcome_of_drop


def issue_n(ledger: Ledger, n: int, step_of=lambda i: i // 2) -> list[str]:
    ids = []
    for i in range(ledger.num_issued, ledger.num_issued + n):
        ledger.issue(f"p{i:08d}", i, step_of(i))
        ids.append(f"p{i:08d}")
    return ids


def check_balance(acc: dict) -> None:
    """issued = sum of outcomes + unresolved."""
    assert acc["issued"] == sum(acc["outcomes"].values()) + len(acc["unresolved"])


def test_outcome_of_drop_reasons():
    assert outcome_of_drop("stale") == "dropped_stale"
    assert outcome_of_drop("filtered: equal_rewards") == "filtered"
    assert outcome_of_drop("filtered") == "filtered"
    for reason in ("failed: RuntimeError", "too_long", "empty_prompt", "stale-ish", ""):
        assert outcome_of_drop(reason) == "failed"


def test_each_outcome_counted_once_and_failed_reasons_kept():
    led = Ledger()
    a, b, c, d, e = issue_n(led, 5)
    assert led.on_trained([a, b]) == [a, b]
    assert led.on_dropped([c], "stale") == [c]
    assert led.on_dropped([d], "filtered: equal_rewards") == [d]
    assert led.on_dropped([e], "too_long") == [e]
    acc = led.accounting()
    assert acc["issued"] == 5 and acc["unresolved"] == []
    assert acc["outcomes"] == {"trained": 2, "dropped_stale": 1, "filtered": 1, "failed": 1}
    assert acc["failed"] == {e: "too_long"}
    assert acc["conflicts"] == [] and acc["unknown"] == []
    check_balance(acc)
    assert led.num_not_trained == 3


def test_first_outcome_wins_repeats_are_not_conflicts():
    led = Ledger()
    a, b, c = issue_n(led, 3)
    assert led.record(a, "dropped_stale", "stale") == "new"
    assert led.record(a, "dropped_stale", "stale") == "repeat"  # re-announced: harmless
    assert led.record(a, "trained") == "conflict"
    assert led.record(b, "failed", "failed: RuntimeError") == "new"
    assert led.record(b, "failed", "too_long") == "repeat"  # same outcome, other reason: first reason kept
    assert led.on_trained([a, c]) == [c]  # a's second trained is another conflict, not a new outcome
    acc = led.accounting()
    assert acc["outcomes"] == {"trained": 1, "dropped_stale": 1, "filtered": 0, "failed": 1}
    assert acc["failed"] == {b: "failed: RuntimeError"}
    assert acc["conflicts"] == [
        {"id": a, "first": "dropped_stale (stale)", "second": "trained"},
        {"id": a, "first": "dropped_stale (stale)", "second": "trained"},
    ]
    assert acc["num_conflicts"] == 2 and acc["num_repeats"] == 2
    check_balance(acc)


def test_unknown_ids_counted_and_listed_up_to_the_bound():
    led = Ledger(max_listed=3)
    (a,) = issue_n(led, 1)
    ghosts = [f"ghost{i}" for i in range(5)]
    assert led.on_dropped(ghosts[:2], "stale") == []
    assert led.on_trained(ghosts[2:]) == []
    acc = led.accounting()
    assert acc["num_unknown"] == 5 and acc["unknown"] == ghosts[:3]
    assert acc["outcomes"] == dict.fromkeys(OUTCOMES, 0) and acc["unresolved"] == [a]
    check_balance(acc)


def test_unresolved_in_issue_order():
    led = Ledger()
    ids = issue_n(led, 6)
    led.on_trained([ids[4], ids[0]])
    led.on_dropped([ids[2]], "stale")
    assert led.unresolved() == [ids[1], ids[3], ids[5]]


def test_issue_refuses_reuse_and_gaps():
    led = Ledger()
    issue_n(led, 2)
    with pytest.raises(ValueError, match="issued already"):
        led.issue("p00000001", 2, 1)
    with pytest.raises(ValueError, match="expected the next index 2"):
        led.issue("p00000005", 5, 2)
    with pytest.raises(ValueError, match="unknown outcome"):
        led.record("p00000000", "lost")
    with pytest.raises(ValueError, match="reserved"):
        led.note("issue", x=1)


def test_rebuild_from_the_journal_after_a_kill(tmp_path):
    led = Ledger(tmp_path)
    ids = issue_n(led, 6)
    led.on_trained(ids[:2])
    led.on_dropped([ids[2]], "failed: RuntimeError")
    led.record(ids[0], "filtered", "filtered: equal_rewards")  # conflict
    led.on_dropped(["ghost"], "stale")  # unknown
    led.note("applied", producer="producer-0", version=3)
    before = led.accounting()
    # no close(): a killed process; every line was flushed when written
    again = Ledger(tmp_path)
    assert again.replayed
    assert again.accounting() == before
    assert again.unresolved() == ids[3:]
    assert [(again.issued[i].index, again.issued[i].step) for i in ids] == [(i, i // 2) for i in range(6)]
    assert again.notes == [{"event": "applied", "producer": "producer-0", "version": 3}]
    # it goes on from there, appending to the same journal
    (nxt,) = issue_n(again, 1)
    assert nxt == "p00000006"
    again.on_trained([ids[3], nxt])
    again.close()
    third = Ledger(tmp_path)
    assert third.num_issued == 7 and third.unresolved() == ids[4:6]
    assert third.counts["trained"] == 4 and third.num_conflicts == 1 and third.num_unknown == 1
    lines = (tmp_path / JOURNAL_NAME).read_text().splitlines()
    assert len(lines) == 6 + 2 + 1 + 1 + 1 + 1 + 1 + 2  # issues, outcomes, conflict, unknown, note, issue, 2 outcomes
    assert all(json.loads(line)["event"] in ("issue", "outcome", "applied") for line in lines)


def test_truncated_last_line_is_dropped_and_appending_goes_on(tmp_path):
    led = Ledger(tmp_path)
    ids = issue_n(led, 3)
    led.on_trained([ids[0]])
    led.close()
    journal = tmp_path / JOURNAL_NAME
    with open(journal, "a") as f:
        f.write('{"event":"outcome","id":"p00000001","outcome":"tra')  # killed mid-write
    again = Ledger(tmp_path)
    assert again.unresolved() == ids[1:]  # the partial outcome never happened
    assert journal.read_text().endswith("\n")
    again.on_dropped([ids[1]], "stale")
    again.close()
    assert Ledger(tmp_path).unresolved() == [ids[2]]


def test_corrupt_line_inside_the_journal_names_file_and_line(tmp_path):
    journal = tmp_path / JOURNAL_NAME
    issue0 = '{"event":"issue","id":"p00000000","index":0,"step":0}\n'
    journal.write_text(issue0 + 'not json\n{"event":"issue","id":"p00000001","index":1,"step":0}\n')
    with pytest.raises(ValueError, match=r"ledger\.jsonl:2: not a JSON line"):
        Ledger(tmp_path)
    journal.write_text('{"event":"issue","id":"p00000000","index":"0","step":0}\n')
    with pytest.raises(ValueError, match=r":1: field 'index' must be int"):
        Ledger(tmp_path)
    journal.write_text(issue0 + '{"event":"issue","id":"p00000002","index":2,"step":0}\n')
    with pytest.raises(ValueError, match=r":2: issue .* out of order"):
        Ledger(tmp_path)


def test_accounting_json_written_atomically_and_throttled(tmp_path):
    led = Ledger(tmp_path, write_interval_s=2.0)
    path = tmp_path / ACCOUNTING_NAME
    ids = issue_n(led, 2)
    assert led.maybe_write_accounting(now=100.0)
    assert json.loads(path.read_text()) == led.accounting()
    led.on_trained([ids[0]])
    assert not led.maybe_write_accounting(now=led._last_write + 1.0)  # too soon after the last write
    assert json.loads(path.read_text())["outcomes"]["trained"] == 0
    assert led.maybe_write_accounting(now=led._last_write + 2.5)
    written = json.loads(path.read_text())
    assert written["outcomes"]["trained"] == 1 and written["unresolved"] == [ids[1]]
    assert not led.maybe_write_accounting(now=led._last_write + 10.0)  # nothing changed
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    led.on_dropped([ids[1]], "too_long")
    led.close()  # the final snapshot
    final = json.loads(path.read_text())
    assert final["unresolved"] == [] and final["failed"] == {ids[1]: "too_long"}
    check_balance(final)
    led.close()  # idempotent


def test_in_memory_ledger_writes_nothing(tmp_path):
    led = Ledger()
    issue_n(led, 1)
    led.write_accounting()
    led.close()
    assert led.journal_path is None and list(tmp_path.iterdir()) == []
