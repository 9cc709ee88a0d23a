"""The ordering of a model's calls (service/sequencer.py), with plain data and a given clock."""

from __future__ import annotations

from service.sequencer import Sequencer


def test_calls_wait_for_lower_seq_ids_and_retries_map_to_the_first_copy():
    s = Sequencer(gap_timeout_s=5.0)
    s.start("m")
    assert s.offer("m", 3, "r3", "c3", now=0.0) == []
    assert s.offer("m", 2, "r2", "c2", now=0.0) == []
    assert s.depth("m") == 2
    assert s.offer("m", 1, "r1", "c1", now=0.0) == ["c1", "c2", "c3"]
    assert s.known("m", 2) == "r2" and s.known("m", 9) is None and s.known("other", 2) is None
    assert s.offer("m", None, "rx", "cx", now=0.0) == ["cx"]  # no seq_id: at once


def test_a_gap_is_closed_after_the_timeout_and_a_late_call_still_runs():
    s = Sequencer(gap_timeout_s=5.0)
    s.start("m")
    assert s.offer("m", 2, "r2", "c2", now=10.0) == [] and s.offer("m", 3, "r3", "c3", now=11.0) == []
    assert s.expire(now=14.9) == []
    assert s.expire(now=15.0) == ["c2", "c3"]
    assert s.offer("m", 1, "r1", "c1", now=16.0) == ["c1"]  # late: run rather than lose it
    assert s.offer("m", 4, "r4", "c4", now=16.0) == ["c4"]


def test_an_unknown_model_starts_at_its_first_seq_id():
    s = Sequencer()
    assert s.offer("x", 7, "r7", "c7", now=0.0) == ["c7"]
    assert s.offer("x", 9, "r9", "c9", now=0.0) == []
    assert s.offer("x", 8, "r8", "c8", now=0.0) == ["c8", "c9"]


def test_calls_held_by_a_restarted_trainer_fail_and_later_ones_run():
    import asyncio

    from bus.messages_api import ApiCall, ApiReply
    from service.futures import Futures

    async def scenario() -> None:
        sent: list[str] = []
        f = Futures(lambda call: sent.append(call.id))
        call = lambda i: ApiCall(id=f"c{i}", op="optim_step", model_id="m", body={})
        reply = lambda i, engine: ApiReply(
            id=f"r{i}", call_id=f"c{i}", ok=True, error="", category="", body={"engine": engine}
        )
        for i in range(4):
            f.submit(call(i))
            await asyncio.sleep(0.001)  # distinct send times
        f.resolve(reply(0, "trainer-a"))
        f.resolve(reply(3, "trainer-b"))  # a new trainer answered c3: c1 and c2 died with trainer-a
        assert sent == ["c0", "c1", "c2", "c3"]
        assert [f.requests[f"c{i}"].reply.ok for i in range(4)] == [True, False, False, True]
        assert "restarted" in f.requests["c1"].reply.error and f.requests["c1"].reply.category == "server"
        assert f.depth("m") == 0

    asyncio.run(scenario())
