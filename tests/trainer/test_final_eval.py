"""trainer.final_eval: the trainer's wait, after its last step, for the final eval round's results on
a real control channel (an XPUB bound here, as the hub's, and the trainer's SUB): it returns as soon
as every task's result is in, names the missing ones after its timeout, ends on a stop, and finds its
results among a flood of other control messages beyond the SUB's high-water mark."""

from __future__ import annotations

import threading
import time

from bus.messages import EvalResult, TrainerStep, new_id
from bus.topics import TOPICS
from configs.schema import load_config
from trainer.final_eval import final_round_tasks, wait_for_round


def result(rnd: int, task: str) -> EvalResult:
    return EvalResult(
        id=new_id(),
        round=rnd,
        task=task,
        version_min=rnd,
        version_max=rnd,
        num_samples=4,
        num_failed=0,
        metrics={"reward_mean": 0.5},
    )


def test_wait_for_round(channel):
    pub, sub = channel
    stop = threading.Event()
    sender = threading.Timer(0.3, lambda: [pub.send(result(4, t)) for t in ("a", "b", "a")])
    sender.start()
    started = time.monotonic()
    assert wait_for_round(sub, 4, ["a", "b"], timeout_s=10.0, stop=stop) == []
    assert 0.2 < time.monotonic() - started < 5.0  # returned as soon as both were in
    sender.join()
    pub.send(result(5, "a"))  # another round's result does not count
    started = time.monotonic()
    assert wait_for_round(sub, 6, ["a", "b"], timeout_s=0.5, stop=stop) == ["a", "b"]
    assert time.monotonic() - started >= 0.5
    stop.set()
    started = time.monotonic()
    assert wait_for_round(sub, 8, ["a"], timeout_s=30.0, stop=stop) == ["a"]  # a stop ends the wait
    assert time.monotonic() - started < 1.0


def test_the_wait_finds_its_results_through_a_flood_beyond_the_high_water_mark(channel):
    """3 x HWM other control messages (~20k/s, far more than a run's control traffic) with the
    results of two tasks among them: the wait reads as they come and finds both."""
    pub, sub = channel
    flood = 3 * TOPICS["control_sub"].hwm

    def publish() -> None:
        for i in range(flood):
            assert pub.send(TrainerStep(id=new_id(), step=1, version=1, metrics={"loss": float(i)}))
            if i in (flood // 3, 2 * flood // 3):
                assert pub.send(result(7, "a" if i == flood // 3 else "b"))
            if i % 500 == 499:
                time.sleep(0.02)

    publisher = threading.Thread(target=publish)
    publisher.start()
    assert wait_for_round(sub, 7, ["a", "b"], timeout_s=60.0, stop=threading.Event()) == []
    publisher.join()


def test_the_final_round_tasks_are_the_eval_tasks():
    cfg = load_config(None, ["eval.tasks=[{name: countdown}, {name: gsm8k}]"])
    assert final_round_tasks(cfg) == ["countdown", "gsm8k"]
    assert final_round_tasks(load_config(None, ["task.name=countdown", "eval.tasks=[]"])) == ["countdown"]
    assert final_round_tasks(load_config(None, ["eval.enabled=false"])) == []
