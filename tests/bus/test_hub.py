"""The control hub forwards in order and catches late joiners up from its last-value cache."""

from __future__ import annotations

from prometheus_client import REGISTRY

from bus.messages import GroupsDropped, Prompt, TrainerStep, WeightsApplied, WeightsReady, new_id


def connect(hub, sockets, sync_control):
    """A publisher and a live subscriber on the hub, synchronized (no slow-joiner loss)."""
    pub = sockets.bus("control_pub", "send", hub.pub_endpoint, bind=False)
    live = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)
    sync_control(
        lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync")),
        lambda: live.recv(timeout_s=0.05),
    )
    return pub, live


def recv_all(sub, timeout_s: float = 0.3) -> list:
    out = []
    while (msg := sub.recv(timeout_s=timeout_s)) is not None:
        out.append(msg)
    return out


def test_live_subscriber_receives_in_order(hub, sockets, sync_control):
    pub, live = connect(hub, sockets, sync_control)
    sent = [TrainerStep(id=new_id(), step=i, version=i + 1, metrics={"loss": float(i)}) for i in range(50)]
    for msg in sent:
        assert pub.send(msg)
    got = [live.recv(timeout_s=2.0) for _ in sent]
    assert [m.id if m else None for m in got] == [m.id for m in sent]
    assert [m.step for m in got] == list(range(50))
    assert live.recv(timeout_s=0.1) is None


def test_late_subscriber_gets_last_values(hub, sockets, sync_control):
    pub, live = connect(hub, sockets, sync_control)
    old = WeightsReady(id="w-2", version=2, method="filesystem", manifest=[], path="/ckpt/v2", num_bytes=10)
    weights = WeightsReady(id="w-3", version=3, method="filesystem", manifest=[], path="/ckpt/v3", num_bytes=10)
    step = TrainerStep(id="s-3", step=3, version=3, metrics={"reward_mean": 0.5})
    dropped = GroupsDropped(id="d-1", group_ids=["g"], reason="stale")  # not a last-value type
    for msg in (old, weights, step, dropped):
        assert pub.send(msg)
    assert [m.id for m in recv_all(live)] == ["w-2", "w-3", "s-3", "d-1"]  # the hub has seen them

    late = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)
    got = recv_all(late)

    assert [(type(m), m.id) for m in got] == [(WeightsReady, "w-3"), (TrainerStep, "s-3")]
    assert got[0].version == 3 and got[0].path == "/ckpt/v3"
    assert got[1].step == 3 and got[1].metrics == {"reward_mean": 0.5}

    # The late joiner is live from then on.
    assert pub.send(TrainerStep(id="s-4", step=4, version=4, metrics={}))
    assert [m.id for m in recv_all(late)] == ["s-4"]


def test_hub_forwards_control_types_only(hub, sockets, sync_control):
    """A well-formed data message published on the control channel is counted and dropped."""
    pub, live = connect(hub, sockets, sync_control)
    before = (
        REGISTRY.get_sample_value("rlbus_bus_rejected_total", {"topic": "control", "reason": "unexpected_type"}) or 0.0
    )
    data = Prompt(id="p-1", index=0, step=0, task="reverse_text", messages=[], info={})
    assert pub.send(data)
    assert pub.send(TrainerStep(id="s-1", step=1, version=1, metrics={}))
    assert [m.id for m in recv_all(live)] == ["s-1"]
    after = REGISTRY.get_sample_value("rlbus_bus_rejected_total", {"topic": "control", "reason": "unexpected_type"})
    assert after == before + 1


def test_late_subscriber_gets_every_producers_latest_applied_version(hub, sockets, sync_control):
    """``weights.applied`` is cached per producer: a prompt source that (re)subscribes learns the
    version each producer runs, also one announced while it was down."""
    pub, live = connect(hub, sockets, sync_control)
    for n, (producer, version) in enumerate([("producer-0", 1), ("producer-1", 1), ("producer-0", 2)]):
        assert pub.send(WeightsApplied(id=f"a-{n}", producer=producer, version=version, apply_time_s=0.1))
    assert len(recv_all(live)) == 3

    late = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)
    applied = [m for m in recv_all(late) if isinstance(m, WeightsApplied)]
    assert sorted((m.producer, m.version) for m in applied) == [("producer-0", 2), ("producer-1", 1)]


def test_cache_keeps_a_bounded_number_of_producers(ctx, endpoint, make_hub, sockets, sync_control):
    cap = 16
    hub = make_hub(ctx, endpoint("control_pub"), endpoint("control_sub"), max_producers=cap)
    pub, live = connect(hub, sockets, sync_control)
    n = cap + 10
    for i in range(n):
        assert pub.send(WeightsApplied(id=f"a-{i}", producer=f"p-{i}", version=1, apply_time_s=0.1))
    assert pub.send(WeightsApplied(id="a-again", producer="p-10", version=2, apply_time_s=0.1))  # p-10 is recent now
    assert len(recv_all(live)) == n + 1

    late = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)
    applied = [(m.producer, m.version) for m in recv_all(late) if isinstance(m, WeightsApplied)]
    # the least recently announced went first, one slot per producer, the newest last
    assert applied == [(f"p-{i}", 1) for i in range(11, n)] + [("p-10", 2)]
    assert hub.hub.evicted == 10
