"""Pure planning of a run on several nodes: which components restart when a binding component
moves to another address (:mod:`busctl.rebinding`), where a Ray restart lands
(:func:`busctl.launchers.ray.pinned_node`), and the metrics targets of a multi-node address map
(:mod:`busctl.metrics_targets`, :func:`busctl.run_status.scrape_config`)."""

from __future__ import annotations

import pytest

from busctl.components.table import ComponentSpec
from busctl.launchers.nodes import Allocation, address_map
from busctl.launchers.ray import pinned_node
from busctl.metrics_targets import live_targets, prometheus_targets, supervisor_metrics_host
from busctl.rebinding import bound_keys, connector_roles, plan_move
from busctl.run_status import scrape_config
from configs.schema import load_config

TABLE = [
    ("hub", "hub"),
    ("trainer", "trainer"),
    ("packer", "packer"),
    ("rewards-0", "rewards"),
    ("rewards-1", "rewards"),
    ("producer-0", "producer"),
    ("producer-1", "producer"),
    ("prompt-source", "prompt-source"),
]

ADDRESSES = {"head": "10.0.0.1", "gpu1": "10.0.0.2", "gpu2": "10.0.0.3"}


def hosts() -> dict[str, str]:
    """``bus.hosts`` of a plain 3-node job: hub, packer, prompt source, trainer on head; producer i on
    gpu(1 + i mod 2)."""
    return address_map(Allocation((("head", "gpu1", "gpu2"),)), 2, "head", ADDRESSES.__getitem__)


def test_the_hub_moving_restarts_everyone_and_busctls_subscription() -> None:
    move = plan_move(hosts(), "hub", "hub", 0, "10.0.0.9", TABLE)
    assert move is not None and move.control_moved and move.broadcast_host is None
    assert move.keys == ("control_pub", "control_sub")
    assert move.restart == tuple(n for n, _ in TABLE if n != "hub")
    assert move.hosts == {**hosts(), "control_pub": "10.0.0.9", "control_sub": "10.0.0.9"}


@pytest.mark.parametrize(
    ("name", "role", "index", "keys", "restart"),
    [
        ("producer-1", "producer", 1, ("rollouts-1",), ("rewards-0", "rewards-1")),
        ("packer", "packer", 0, ("scored", "batches"), ("trainer", "rewards-0", "rewards-1")),
        (
            "prompt-source",
            "prompt-source",
            0,
            ("prompts", "outcomes"),
            ("trainer", "packer", "producer-0", "producer-1"),
        ),
        ("trainer", "trainer", 0, ("weights",), ("producer-0", "producer-1")),
    ],
)
def test_each_binder_restarts_exactly_its_connectors(name, role, index, keys, restart) -> None:
    move = plan_move(hosts(), name, role, index, "10.0.0.9", TABLE)
    assert move is not None and (move.keys, move.restart) == (keys, restart) and not move.control_moved
    assert {k: move.hosts[k] for k in keys} == dict.fromkeys(keys, "10.0.0.9")
    assert {k: v for k, v in move.hosts.items() if k not in keys} == {k: v for k, v in hosts().items() if k not in keys}
    assert move.broadcast_host == ("10.0.0.9" if role == "trainer" else None)


def test_nothing_moves_at_the_same_address_for_a_connector_or_on_one_host() -> None:
    assert plan_move(hosts(), "producer-0", "producer", 0, "10.0.0.2", TABLE) is None  # restarted where it was
    assert plan_move(hosts(), "rewards-1", "rewards", 1, "10.0.0.9", TABLE) is None  # binds nothing
    assert plan_move(hosts(), "hub", "hub", 0, "", TABLE) is None  # the local launcher places no address
    assert plan_move({}, "hub", "hub", 0, "10.0.0.9", TABLE) is None  # no bus.hosts: a single-host run


def test_bound_keys_and_connectors_follow_the_topic_table() -> None:
    assert bound_keys("hub") == ("control_pub", "control_sub") and bound_keys("producer", 3) == ("rollouts-3",)
    assert bound_keys("rewards") == () and bound_keys("trainer") == ("weights",)
    assert connector_roles("rollouts-7") == {"rewards"} and connector_roles("outcomes") == {
        "trainer",
        "packer",
        "producer",
    }
    with pytest.raises(ValueError, match="unknown endpoint key 'rollouts-x'"):
        connector_roles("rollouts-x")


def test_a_ray_restart_stays_on_its_node_while_it_lives() -> None:
    before = Allocation((("head", "a", "b"),))
    assert pinned_node(before, "producer", 1, None) == "b"  # first spawn: the plan
    after = Allocation((("head", "b"),))  # node a died: the plan now puts producer 1 on b, and producer 0 too
    assert pinned_node(after, "producer", 1, "b") == "b"
    assert pinned_node(after, "producer", 0, "a") == "b"  # its node is gone: planned anew
    grown = Allocation((("head", "a", "b", "c"),))  # a node joined: the plan would put producer 1 on c
    assert pinned_node(grown, "producer", 1, "b") == "b"


def spec(name: str, host: str, port: int, state: str = "running") -> ComponentSpec:
    s = ComponentSpec(name, "x", state=state, metrics_port=port)
    s.metrics_host = host
    return s


def test_metrics_targets_name_each_components_node() -> None:
    table = [
        spec("hub", "10.0.0.1", 9001),
        spec("producer-0", "10.0.0.2", 9002),
        spec("producer-1", "10.0.0.3", 9003),
        spec("rewards-0", "10.0.0.2", 9004, state="restarting"),
        spec("trainer", "10.0.0.1", 0, state="starting"),
    ]
    assert live_targets(table) == [
        ("hub", "10.0.0.1", 9001),
        ("producer-0", "10.0.0.2", 9002),
        ("producer-1", "10.0.0.3", 9003),
    ]
    config = scrape_config("r", prometheus_targets(table, ("10.0.0.1", 9000)))
    statics = {
        s["labels"]["component"]: (s["targets"], s["labels"]["role"])
        for s in config["scrape_configs"][0]["static_configs"]
    }
    assert statics == {
        "hub": (["10.0.0.1:9001"], "hub"),
        "producer-0": (["10.0.0.2:9002"], "producer"),
        "producer-1": (["10.0.0.3:9003"], "producer"),
        "rewards-0": (["10.0.0.2:9004"], "rewards"),
        "supervisor": (["10.0.0.1:9000"], "supervisor"),
    }  # the trainer has no port yet: left out


def test_busctl_serves_its_metrics_on_its_node_only_on_several_nodes() -> None:
    assert supervisor_metrics_host(load_config(None, [])) == "127.0.0.1"
    multi = load_config(None, ["bus.transport=tcp"])
    multi.bus.hosts = hosts()
    assert supervisor_metrics_host(multi) == "10.0.0.1"
