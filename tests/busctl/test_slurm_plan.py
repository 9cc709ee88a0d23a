"""Pure parts of the Slurm launcher: node plans, the bus address map, the allocation read from
the environment, and the batch script ``busctl sbatch`` writes (no Slurm needed)."""

from __future__ import annotations

import pytest

from busctl.launchers.nodes import Allocation, Slot, address_map, plan_nodes
from busctl.launchers.sbatch import sbatch_script
from busctl.launchers.slurm import allocation_from_environ
from configs.schema import ConfigError, load_config


def split(nodelist: str) -> list[str]:
    """A stand-in for ``scontrol show hostnames`` on lists without brackets."""
    return nodelist.split(",")


def test_one_node_holds_everything() -> None:
    alloc = Allocation((("n1",),))
    for role, index in [
        ("hub", 0),
        ("trainer", 0),
        ("packer", 0),
        ("prompt-source", 0),
        ("producer", 3),
        ("rewards", 5),
    ]:
        assert plan_nodes(alloc, role, index) == Slot("n1")


def test_plain_job_spreads_producers_and_rewards() -> None:
    alloc = Allocation((("a", "b", "c"),))
    assert [plan_nodes(alloc, r).node for r in ("hub", "trainer", "packer", "prompt-source")] == ["a"] * 4
    assert [plan_nodes(alloc, "producer", i).node for i in range(4)] == ["b", "c", "b", "c"]
    assert [plan_nodes(alloc, "rewards", i).node for i in range(4)] == ["a", "b", "c", "a"]


def test_heterogeneous_job_places_by_component() -> None:
    alloc = Allocation((("g1", "g2"), ("t1", "t2"), ("c1",)))
    assert plan_nodes(alloc, "producer", 1) == Slot("g2", 0)
    assert plan_nodes(alloc, "producer", 2) == Slot("g1", 0)
    assert plan_nodes(alloc, "trainer") == Slot("t1", 1)
    assert plan_nodes(alloc, "rewards", 3) == Slot("c1", 2)
    assert plan_nodes(alloc, "hub") == Slot("c1", 2)
    with pytest.raises(ValueError, match="index"):
        plan_nodes(alloc, "producer", -1)


def test_allocation_must_be_whole() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        Allocation((("a",), ()))
    with pytest.raises(ValueError, match="3 components"):
        Allocation((("a",), ("b",)))


def test_address_map_names_each_binder() -> None:
    alloc = Allocation((("a", "b", "c"),))
    hosts = address_map(alloc, 3, "login", resolve=lambda n: f"10.0.0.{ord(n[0]) - 96}" if len(n) == 1 else "10.9.9.9")
    assert hosts == {
        "control_pub": "10.0.0.1",
        "control_sub": "10.0.0.1",
        "prompts": "10.0.0.1",
        "outcomes": "10.0.0.1",
        "scored": "10.0.0.1",
        "batches": "10.0.0.1",
        "weights": "10.0.0.1",
        "rollouts-0": "10.0.0.2",
        "rollouts-1": "10.0.0.3",
        "rollouts-2": "10.0.0.2",
        "supervisor": "10.9.9.9",
    }
    cfg = load_config(None, ["bus.transport=tcp"])
    cfg.bus.hosts = hosts
    from bus.topics import Endpoints

    ep = Endpoints("tcp", cfg.run_dir, "127.0.0.1", 6000, hosts)
    assert ep.address("rollouts", 1) == "tcp://10.0.0.3:6011"
    assert ep.address("supervisor") == "tcp://10.9.9.9:6005"
    assert ep.address("weights") == "tcp://10.0.0.1:6009"  # the trainer's node (broadcast.method: bus)
    het = address_map(Allocation((("gpu0",), ("gpu1",), ("cpu0",))), 1, "cpu0", resolve=lambda n: n)
    assert het["weights"] == "gpu1" and het["rollouts-0"] == "gpu0"  # the bus method's endpoint is the trainer's


def test_unknown_bus_hosts_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="rollouts-I"):
        load_config(None, ["bus.hosts={rollout-0: x}"])


def test_allocation_from_environ() -> None:
    with pytest.raises(ConfigError, match="inside a Slurm allocation"):
        allocation_from_environ({}, split)
    assert allocation_from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b"}, split).groups == (("a", "b"),)
    het = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "a,b,c",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "a",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "b",
        "SLURM_JOB_NODELIST_HET_GROUP_2": "c",
    }
    assert allocation_from_environ(het, split).groups == (("a",), ("b",), ("c",))
    del het["SLURM_JOB_NODELIST_HET_GROUP_2"]
    with pytest.raises(ConfigError, match="busctl sbatch"):
        allocation_from_environ(het, split)


def test_sbatch_plain_and_heterogeneous() -> None:
    plain = sbatch_script(load_config(None, ["slurm.nodes=2"]), "my config.yaml", ["trainer.max_steps=3"], python="py")
    assert "#SBATCH --nodes=2" in plain and "hetjob" not in plain
    assert plain.rstrip().endswith("py -m busctl up --launcher slurm 'my config.yaml' trainer.max_steps=3")
    het = sbatch_script(
        load_config(
            None,
            [
                "slurm.inference_nodes=2",
                "slurm.trainer_nodes=1",
                "slurm.cpu_nodes=1",
                "slurm.gpus_per_node=8",
                "slurm.partition=gpu",
            ],
        ),
        None,
        [],
        python="py",
    )
    assert het.count("#SBATCH hetjob") == 2
    assert het.count("#SBATCH --gpus-per-node=8") == 2  # the CPU component asks for none
    assert [line for line in het.splitlines() if line.startswith("#SBATCH --nodes")] == [
        "#SBATCH --nodes=2",
        "#SBATCH --nodes=1",
        "#SBATCH --nodes=1",
    ]
    with pytest.raises(ValueError, match="all three"):
        sbatch_script(load_config(None, ["slurm.inference_nodes=2"]), None, [])
