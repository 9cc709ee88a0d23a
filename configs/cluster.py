"""The cluster config section (pydantic): how ``busctl sbatch`` asks Slurm for nodes.

Re-exported by :mod:`configs.schema`; imports nothing heavy. Which launcher ``busctl up`` uses
is ``supervisor.launcher``; this section only shapes the batch script ``busctl sbatch`` writes
(:mod:`busctl.launchers.sbatch`).
"""

from __future__ import annotations

from pydantic import Field

from configs.base import Section


class SlurmConfig(Section):
    """The Slurm job ``busctl sbatch`` writes: a plain job of ``nodes`` nodes, or a heterogeneous
    job (inference, trainer and CPU components) when all three ``*_nodes`` are > 0."""

    nodes: int = Field(1, ge=1, le=100_000, description="Nodes of a plain (not heterogeneous) job.")
    inference_nodes: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Nodes of the producers' het-job component; 0 with trainer_nodes and cpu_nodes 0: a plain job.",
    )
    trainer_nodes: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Nodes of the trainer's het-job component (the trainer runs on its first node).",
    )
    cpu_nodes: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Nodes of the CPU het-job component (hub, packer, prompt source, reward workers).",
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs asked per GPU node (--gpus-per-node); 0: none asked.")
    partition: str = Field("", description="--partition of every job component; empty: the cluster's default.")
    time: str = Field("01:00:00", pattern=r"^[0-9:-]+$", description="--time limit of the job (Slurm's [D-]HH:MM:SS).")
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="Extra #SBATCH options, one per item, e.g. --account=proj (applied to the first job component).",
    )
