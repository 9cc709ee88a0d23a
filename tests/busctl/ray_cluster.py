"""A real multi-node Ray cluster on this machine, for tests (``ray.cluster_utils.Cluster``).

:func:`ray_cluster` (module scope: stopped after the module, so idle Ray daemons do not sit on the
cores through the rest of the suite) starts a head node (no role resource: a CPU node for
:mod:`busctl.launchers.ray`) and two worker nodes, one offering the custom resource
``producer`` (an inference node) and one ``trainer``; one CPU each, no dashboard, the smallest
object store, so they leave the machine's cores to the pipeline. Tests may add and remove nodes
of their own (:meth:`ray.cluster_utils.Cluster.add_node` / ``remove_node``). Skipped, with the
reason, without the ``ray`` package (the ``ray`` extra; ``make test`` installs it).
"""

from __future__ import annotations

from typing import Iterator

import pytest

OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Per node; Ray's minimum is 75 MiB."""

NODE_ARGS = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """The running ``Cluster``; attribute ``role_nodes``: ``{"producer": Node, "trainer": Node}``."""
    pytest.importorskip("ray", reason="the Ray launcher tests need the ray package (pip install 'rlbus[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    cluster.role_nodes = {role: cluster.add_node(**NODE_ARGS, resources={role: 1}) for role in ("producer", "trainer")}
    cluster.wait_for_nodes()
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()
