"""The settings a run on several nodes needs, written into its config by the Slurm and Ray launchers.

:func:`configure_multihost` sets tcp transport, ``bus.hosts`` (the node that binds each endpoint),
``broadcast.method: bus`` unless one was given, the weight broadcast's rendezvous at the trainer's node, and
(unless ``bus.curve_keys_dir`` is given) a CurveZMQ key directory ``RUN_DIR/curve_keys`` for this run (mode
0700, kept across ``--resume``) with a metrics TLS server certificate per node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from bus.auth import create_keys
from telemetry.certs import node_hosts
from busctl.launchers.nodes import Allocation, address_map, plan_nodes
from configs.schema import RunConfig, apply_weight_method_default

BROADCAST_PORT_OFFSET = 7
"""The weight broadcast's rendezvous port when the trainer is on another node: ``bus.base_port + 7``
(an offset no topic uses, :mod:`bus.topics`)."""


def configure_multihost(
    cfg: RunConfig, alloc: Allocation, resolve: Callable[[str], str], supervisor_host: str, here: str
) -> None:
    """Write the multi-node settings into ``cfg`` (in place); ``resolve``: node name -> address;
    ``supervisor_host``: busctl's host; ``here``: busctl's node in ``alloc`` (a trainer elsewhere gets the fixed
    broadcast port ``bus.base_port + BROADCAST_PORT_OFFSET``: busctl cannot probe a remote port)."""
    cfg.bus.transport = "tcp"
    apply_weight_method_default(cfg)  # broadcast.method unset: the bus method (CurveZMQ), not an open rendezvous
    cfg.bus.hosts = address_map(alloc, cfg.producers.max_replicas, supervisor_host, resolve)
    trainer_node = plan_nodes(alloc, "trainer").node
    cfg.broadcast.host = resolve(trainer_node)
    if trainer_node != here and not cfg.broadcast.port:
        cfg.broadcast.port = cfg.bus.base_port + BROADCAST_PORT_OFFSET
    if not cfg.bus.curve_keys_dir:
        keys = (Path(cfg.run_dir) / "curve_keys").resolve()
        if (
            not (keys / "server.key_secret").exists() or not (keys / "tls").exists()
        ):  # tls/: a run from before metrics TLS
            keys.parent.mkdir(parents=True, exist_ok=True)
            nodes = {n: resolve(n) for group in alloc.groups for n in group} | {
                supervisor_host: resolve(supervisor_host)
            }
            create_keys(keys, hosts=node_hosts(nodes))  # one metrics server certificate per node, naming its address
        cfg.bus.curve_keys_dir, cfg.bus.curve_client = str(keys), "components"
