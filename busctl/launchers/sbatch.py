"""``busctl sbatch``: the batch script that runs a config's job under Slurm (a pure function).

The script asks for the nodes ``slurm.*`` describes (a plain job, or a heterogeneous one of inference, trainer
and CPU components separated by ``#SBATCH hetjob`` when all three counts are > 0; every component
``--exclusive``) and runs ``busctl up --launcher slurm CONFIG`` on the job's first node, with the config path
and overrides quoted for the shell.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from busctl.launchers.nodes import HET_GROUPS
from configs.schema import RunConfig


def _component(nodes: int, gpus: int, partition: str) -> list[str]:
    lines = [f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
    lines += [f"#SBATCH --gpus-per-node={gpus}"] * bool(gpus) + [f"#SBATCH --partition={partition}"] * bool(partition)
    return lines


def sbatch_script(
    cfg: RunConfig,
    config_path: str | None,
    overrides: list[str],
    python: str = sys.executable,
    workdir: str | Path | None = None,
    overwrite: bool = False,
) -> str:
    """The batch script of ``cfg``; ``config_path`` / ``overrides``: what ``busctl up`` is given (None: the default
    config); ``workdir``: default the current one, visible on every node; ``overwrite``: the job runs
    ``busctl up --overwrite``.

    Raises:
        ValueError: only some of ``slurm.inference_nodes / trainer_nodes / cpu_nodes`` are > 0.
    """
    s = cfg.slurm
    het = [s.inference_nodes, s.trainer_nodes, s.cpu_nodes]
    if any(het) and not all(het):
        raise ValueError(
            f"slurm.inference_nodes, trainer_nodes and cpu_nodes: all three > 0 for a heterogeneous job, or "
            f"all 0 for a plain one; got {het}"
        )
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name=rlbus-{cfg.name}",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={Path(cfg.run_dir).resolve()}-slurm-%j.out",
        *(f"#SBATCH {a}" for a in s.sbatch_args),
    ]
    if all(het):
        gpus = [s.gpus_per_node, s.gpus_per_node, 0]
        parts = [_component(n, g, s.partition) for n, g in zip(het, gpus)]
        body = [line for k, part in enumerate(parts) for line in ([] if k == 0 else ["#SBATCH hetjob"]) + part]
        what = "heterogeneous job: " + ", ".join(f"{name} {n} node(s)" for name, n in zip(HET_GROUPS, het))
    else:
        body = _component(s.nodes, s.gpus_per_node, s.partition)
        what = f"plain job: {s.nodes} node(s)"
    args = [
        python,
        "-m",
        "busctl",
        "up",
        "--launcher",
        "slurm",
        *(["--overwrite"] if overwrite else []),
        *([config_path] if config_path else []),
        *overrides,
    ]
    return "\n".join(
        [
            *head,
            *body,
            f"# written by busctl sbatch; {what}",
            "set -euo pipefail",
            f"cd {shlex.quote(str(Path(workdir or Path.cwd()).resolve()))}",
            shlex.join(args),
            "",
        ]
    )
