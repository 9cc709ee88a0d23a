"""Tests for producers.eval_gate.EvalUpdateGate: the producers' gate that keeps every eval group
under one policy version."""

from __future__ import annotations

import asyncio

from producers.eval_gate import EvalUpdateGate


def test_update_waits_for_in_flight_evals_and_blocks_new_ones():
    async def scenario():
        gate, log = EvalUpdateGate(), []
        eval_may_finish = asyncio.Event()

        async def eval_group(name, hold=None):
            async with gate.eval_request():
                log.append(f"{name} start")
                if hold is not None:
                    await hold.wait()
                log.append(f"{name} end")

        async def update():
            async with gate.update():
                log.append("update start")
                await asyncio.sleep(0.01)
                log.append("update end")

        first = asyncio.create_task(eval_group("eval1", eval_may_finish))
        await asyncio.sleep(0.01)
        upd = asyncio.create_task(update())
        await asyncio.sleep(0.01)
        second = asyncio.create_task(eval_group("eval2"))  # arrives while the update is pending
        await asyncio.sleep(0.01)
        assert log == ["eval1 start"] and gate.updates_pending == 1
        eval_may_finish.set()
        await asyncio.gather(first, upd, second)
        return log

    assert asyncio.run(scenario()) == [
        "eval1 start",
        "eval1 end",
        "update start",
        "update end",
        "eval2 start",
        "eval2 end",
    ]


def test_update_without_evals_does_not_wait_and_a_cancelled_update_releases_the_gate():
    async def scenario():
        gate = EvalUpdateGate()
        async with gate.update():
            pass
        hold = asyncio.Event()

        async def eval_group():
            async with gate.eval_request():
                await hold.wait()

        running = asyncio.create_task(eval_group())
        await asyncio.sleep(0.01)

        async def update():
            async with gate.update():
                pass

        upd = asyncio.create_task(update())
        await asyncio.sleep(0.01)
        upd.cancel()
        await asyncio.gather(upd, return_exceptions=True)
        assert gate.updates_pending == 0
        async with gate.eval_request():  # not blocked by the cancelled update
            pass
        hold.set()
        await running
        return gate.evals_in_flight, gate.updates_pending

    assert asyncio.run(scenario()) == (0, 0)


def test_round_hold_keeps_a_round_on_its_version_until_every_task_reported():
    from configs.schema import load_config
    from producers.eval_gate import EvalRoundHold

    cfg = load_config(None, ["trainer.max_steps=60", "eval.interval=25"])
    rounds = cfg.eval.round_versions(cfg.trainer.max_steps)
    assert rounds == [0, 25, 50, 60]
    hold = EvalRoundHold(rounds, {"a", "b"}, timeout_s=5.0)
    assert hold.holds(0, 1) and hold.holds(25, 26) and hold.holds(25, 27)  # the round's version stays
    assert not hold.holds(1, 2) and not hold.holds(24, 25) and not hold.holds(25, 25)  # not a round: no wait
    hold.on_result(25, "a")
    assert hold.holds(25, 26)  # one task of two
    hold.on_result(25, "b")
    assert not hold.holds(25, 26) and hold.holds(50, 51)
    hold.on_result(7, "a")  # a result of no round: noted, nothing opens or closes
    hold.forget_through(50)  # a restarted producer at version 50: round 50 may be a re-run
    assert not hold.holds(0, 1) and not hold.holds(50, 51) and hold.holds(60, 61)
