"""The device plan of a run: which CUDA devices each component sees (``CUDA_VISIBLE_DEVICES``).

``busctl up`` plans once, before anything is spawned, from the config and the devices busctl sees
(:func:`visible_devices`), and refuses a plan that does not fit with a :class:`configs.schema.ConfigError`
naming the keys to change and the devices seen. The plan resolves ``trainer.device``, ``producers.dtype`` and
``broadcast.backend`` (``auto`` -> concrete) into the run's ``config.yaml``. The rules (trainer devices,
producer slices with or without sharing, the 0.7 memory split, nccl vs gloo, scaled indices) are in
docs/operations.md, "GPUs". Device numbers are busctl's own; inside a component its devices are
``cuda:0 ..``. No torch import (busctl stays light).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, replace
from typing import Mapping

from broadcaster.dtypes import resolve_producer_dtype
from configs.schema import ConfigError, RunConfig

ENV_CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The variable CUDA (and so torch and vLLM) reads the usable devices from."""

NVIDIA_SMI_TIMEOUT_S = 20.0
"""Longest wait for ``nvidia-smi -L``, seconds."""

_GPU_LINE = re.compile(r"^GPU (\d+):")

MAX_VLLM_SHARE_BESIDE_TRAINER = 0.7
"""The largest fraction of a CUDA trainer's GPU its sharing producers' vLLM engines may take together: the
trainer keeps 30% for weights, gradients, AdamW state (~16 bytes per parameter in float32) and activations."""


def visible_devices(environ: Mapping[str, str] | None = None, nvidia_smi: str = "nvidia-smi") -> list[int]:
    """The CUDA device indices busctl may hand out (e.g. ``[0, 1]``; ``[]`` without CUDA), without torch.

    busctl's own ``CUDA_VISIBLE_DEVICES`` (``environ``, default ``os.environ``) when set (an entry < 0 ends the
    list, as in CUDA), else the ``GPU N:`` lines of ``nvidia-smi -L`` (none if it is missing or fails).

    Raises:
        ConfigError: ``CUDA_VISIBLE_DEVICES`` holds an entry that is not an index (a GPU UUID).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_CUDA_DEVICES)
    if raw is not None:
        devices: list[int] = []
        for entry in (e.strip() for e in raw.split(",") if e.strip()):
            if not re.fullmatch(r"-?\d+", entry):
                raise ConfigError(
                    f"{ENV_CUDA_DEVICES}={raw!r}: busctl places components by device index; give indices "
                    f"(e.g. 0,1), not {entry!r}"
                )
            if int(entry) < 0:
                break
            devices.append(int(entry))
        return devices
    try:
        out = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [int(m.group(1)) for line in out.stdout.splitlines() if (m := _GPU_LINE.match(line.strip()))]


@dataclass(frozen=True)
class Placement:
    """The device plan of one run (built by :func:`plan_placement`); the other fields are the resolved config.

    Attributes:
        trainer_gpus: the trainer's devices, one per data-parallel rank (empty on CPU).
        producer_gpus: per producer index ``0 .. max_replicas - 1``, its devices; ``()`` for vLLM on CPU;
            ``None`` for an index that does not fit (scaling to it is refused).
    """

    visible: tuple[int, ...]
    trainer_device: str
    trainer_gpus: tuple[int, ...]
    producer_dtype: str
    broadcast_backend: str
    producer_gpus: tuple[tuple[int, ...] | None, ...]
    shared: bool = False
    replicas: int = 1
    gpus_per_replica: int = 1
    gpu_memory_utilization: float = 0.0

    @property
    def producers_on_gpu(self) -> bool:
        """Whether the producers run vLLM on GPUs."""
        return any(self.producer_gpus)

    def devices(self, role: str, index: int = 0) -> tuple[int, ...]:
        """The devices of component ``role`` (``"trainer"``, ``"producer"``, ...) replica ``index``.

        Raises:
            ValueError: a producer index the plan has no devices for (see :meth:`check_producers`).
        """
        if role == "trainer":
            return self.trainer_gpus
        if role != "producer":
            return ()
        gpus = self.producer_gpus[index] if index < len(self.producer_gpus) else None
        if gpus is None:
            raise ValueError(f"producer-{index} has no devices in this plan: {self.refusal(index + 1)}")
        return gpus

    def environ(self, role: str, index: int = 0) -> dict[str, str]:
        """``{"CUDA_VISIBLE_DEVICES": "0,1"}`` for the component (``""``: no GPU).

        Raises:
            ValueError: as :meth:`devices`.
        """
        return {ENV_CUDA_DEVICES: ",".join(str(d) for d in self.devices(role, index))}

    def refusal(self, producers: int) -> str:
        """Why ``producers`` replicas do not fit: what is needed, what is visible, the keys to change."""
        per = self.gpus_per_replica
        return (
            f"{len(self.trainer_gpus) + producers * per} GPUs needed (trainer {len(self.trainer_gpus)} + producers "
            f"{producers} x {per}), {len(self.visible)} visible: {list(self.visible)}; set "
            "producers.share_gpus_with_trainer: true (with producers.gpu_memory_utilization ~0.35: vLLM's share of the "
            f"GPU, at most {MAX_VLLM_SHARE_BESIDE_TRAINER} beside the trainer), or lower producers.replicas / "
            "producers.gpus_per_replica / trainer.data_parallel, or put the producers on CPU with "
            "producers.gpus_per_replica: 0"
        )

    def check_producers(self, n: int) -> None:
        """Check that ``n`` producer replicas (``busctl scale producers=n``) have devices.

        Raises:
            ConfigError: one of the first ``n`` indices has none, or they would take more than
                :data:`MAX_VLLM_SHARE_BESIDE_TRAINER` of a CUDA trainer's GPU together.
        """
        if any(g is None for g in self.producer_gpus[:n]):
            raise ConfigError(f"producers={n} does not fit the GPUs: {self.refusal(n)}")
        if self.trainer_device == "cuda":
            try:
                _check_memory_split(self.gpu_memory_utilization, self.trainer_gpus, list(self.producer_gpus[:n]))
            except ConfigError as err:
                raise ConfigError(f"producers={n} does not fit the GPUs' memory: {err}") from None

    def resolve(self, cfg: RunConfig) -> None:
        """Write the plan's concrete values into ``cfg``, so every component reads them from ``config.yaml``."""
        cfg.trainer.device = self.trainer_device
        cfg.producers.dtype = self.producer_dtype
        cfg.broadcast.backend = self.broadcast_backend

    def describe(self) -> str:
        """The plan as lines for ``busctl up --dry-run`` and the console (``#``-prefixed: YAML comments)."""

        def env(gpus: tuple[int, ...] | None) -> str:
            return (
                "no devices: busctl scale refuses it"
                if gpus is None
                else f"{ENV_CUDA_DEVICES}={','.join(map(str, gpus))!r}"
            )

        lines = [
            f"# placement: CUDA devices visible to busctl: {list(self.visible)}",
            f"#   trainer: {self.trainer_device}, {env(self.trainer_gpus)}; weights to the producers over "
            f"{self.broadcast_backend}",
        ]
        i, n = 0, len(self.producer_gpus)
        while i < n:  # scaled indices with the same devices share a line
            gpus, last = self.producer_gpus[i], i
            while i >= self.replicas and last + 1 < n and self.producer_gpus[last + 1] == gpus:
                last += 1
            names = (
                f"producer-{i}"
                + (f" .. producer-{last}" if last > i else "")
                + (" (busctl scale)" if i >= self.replicas else "")
            )
            kind = "cuda" if gpus else "cpu" if gpus is not None else "-"
            lines.append(f"#   {names}: {kind}, {self.producer_dtype}, {env(gpus)}")
            i = last + 1
        lines.append(f"#   hub, packer, rewards-*, prompt-source: {ENV_CUDA_DEVICES}=''")
        return "\n".join(lines)


def _trainer_gpus(cfg: RunConfig, visible: list[int]) -> tuple[str, tuple[int, ...]]:
    """The resolved ``trainer.device`` and the trainer's devices; ConfigError when CUDA cannot be satisfied."""
    t = cfg.trainer
    device = t.device if t.device != "auto" else ("cuda" if visible else "cpu")
    if device == "cpu":
        if t.data_parallel > 1 and t.dp_backend == "nccl":
            raise ConfigError(
                f"trainer.dp_backend nccl needs the trainer on CUDA but trainer.device resolves to cpu "
                f"(CUDA devices visible: {visible}); use trainer.dp_backend: gloo (or auto)"
            )
        if t.gpus:
            raise ConfigError(
                f"trainer.gpus {t.gpus} but no CUDA device is visible to busctl ({ENV_CUDA_DEVICES} or "
                "nvidia-smi); remove trainer.gpus to train on CPU"
            )
        return "cpu", ()
    if not visible:
        raise ConfigError(
            f"trainer.device is cuda but no CUDA device is visible to busctl (its {ENV_CUDA_DEVICES}: "
            f"{os.environ.get(ENV_CUDA_DEVICES, 'unset')}, nvidia-smi: none); set trainer.device: cpu (or auto)"
        )
    if t.data_parallel > 1 and t.dp_backend == "gloo":
        raise ConfigError(
            "trainer.dp_backend gloo keeps data-parallel ranks on the CPU but trainer.device resolves to "
            f"cuda (CUDA devices visible: {visible}); use trainer.dp_backend: auto (nccl) or trainer.device: cpu"
        )
    if t.gpus:
        missing = [g for g in t.gpus if g not in visible]
        if missing:
            raise ConfigError(
                f"trainer.gpus {t.gpus}: {missing} not among the CUDA devices visible to busctl: {visible}"
            )
        return "cuda", tuple(t.gpus)
    if t.data_parallel > len(visible):
        raise ConfigError(
            f"trainer.data_parallel={t.data_parallel} ranks need {t.data_parallel} GPUs (one each), "
            f"{len(visible)} visible: {visible}; lower trainer.data_parallel or set trainer.device: cpu"
        )
    return "cuda", tuple(visible[: t.data_parallel])


def _broadcast_backend(
    cfg: RunConfig, trainer_gpus: tuple[int, ...], producer_gpus: list[tuple[int, ...] | None]
) -> str:
    """The resolved ``broadcast.backend``; ConfigError for ``nccl`` with a member off CUDA or two on one GPU."""
    b = cfg.broadcast
    if b.method != "broadcast":
        return b.backend
    group = [trainer_gpus[:1], *producer_gpus[: cfg.producers.replicas]]
    used = [d for gpus in group for d in gpus or ()]
    on_cuda, distinct = all(group), len(used) == len(set(used))
    if b.backend == "auto":
        return "nccl" if on_cuda and distinct else "gloo"
    if b.backend == "nccl" and not (on_cuda and distinct):
        why = "a member is not on CUDA" if not on_cuda else "NCCL cannot put two ranks on one GPU"
        raise ConfigError(
            f"broadcast.backend nccl: the weight-broadcast group (trainer {list(trainer_gpus[:1])}, producers "
            f"{[list(g or ()) for g in group[1:]]}) cannot use NCCL: {why}; set broadcast.backend: gloo (or auto) "
            "or broadcast.method: filesystem"
        )
    return b.backend


def plan_placement(cfg: RunConfig, visible: list[int]) -> Placement:
    """The device plan of ``cfg`` (read only) on a host where busctl sees CUDA devices ``visible`` (pure).

    Raises:
        ConfigError: the plan does not fit, ``trainer.device: cuda`` with none visible, or ``broadcast.backend:
            nccl`` the plan cannot honour; the message names the keys to change and the devices seen.
    """
    p = cfg.producers
    trainer_device, trainer_gpus = _trainer_gpus(cfg, list(visible))
    per = p.gpus_per_replica
    if not visible or per == 0:
        producer_gpus: list[tuple[int, ...] | None] = [()] * p.max_replicas
    elif p.share_gpus_with_trainer:
        pool = [d for d in visible if d not in trainer_gpus] + list(trainer_gpus)
        if per > len(pool):
            raise ConfigError(
                f"producers.gpus_per_replica={per} (tensor_parallel_size) needs {per} distinct GPUs, "
                f"{len(pool)} visible: {list(visible)}; lower producers.tensor_parallel_size"
            )
        producer_gpus = [tuple(pool[(i * per + k) % len(pool)] for k in range(per)) for i in range(p.max_replicas)]
    else:
        free = [d for d in visible if d not in trainer_gpus]
        producer_gpus = [
            tuple(free[i * per : (i + 1) * per]) if (i + 1) * per <= len(free) else None for i in range(p.max_replicas)
        ]
    dtype = resolve_producer_dtype(p.dtype, cuda_available=any(producer_gpus))
    plan = Placement(
        tuple(visible),
        trainer_device,
        trainer_gpus,
        dtype,
        "",
        tuple(producer_gpus),
        shared=p.share_gpus_with_trainer,
        replicas=p.replicas,
        gpus_per_replica=per,
        gpu_memory_utilization=p.gpu_memory_utilization,
    )
    if any(g is None for g in producer_gpus[: p.replicas]):
        raise ConfigError(f"the GPU plan does not fit: {plan.refusal(p.replicas)}")
    plan = replace(plan, broadcast_backend=_broadcast_backend(cfg, trainer_gpus, producer_gpus))
    if trainer_device == "cuda":
        _check_memory_split(p.gpu_memory_utilization, trainer_gpus, producer_gpus[: p.replicas])
    return plan


def _check_memory_split(fraction: float, trainer_gpus: tuple[int, ...], producer_gpus: list) -> None:
    """ConfigError when the producers on a trainer GPU take more than :data:`MAX_VLLM_SHARE_BESIDE_TRAINER`."""
    for gpu in trainer_gpus:
        sharing = sum(1 for g in producer_gpus if g and gpu in g)
        taken = sharing * fraction
        if sharing and taken > MAX_VLLM_SHARE_BESIDE_TRAINER + 1e-9:
            fits = MAX_VLLM_SHARE_BESIDE_TRAINER / sharing
            raise ConfigError(
                f"producers.gpu_memory_utilization {fraction} x {sharing} producer(s) on GPU {gpu}, which the trainer "
                f"uses too: vLLM would take {taken:.0%} of it and leave the trainer {max(1 - taken, 0):.0%} for its "
                f"weights, gradients, AdamW state and activations; set producers.gpu_memory_utilization <= {fits:.2f} "
                f"(e.g. {min(0.35, fits):.2f}; at most {MAX_VLLM_SHARE_BESIDE_TRAINER:.0%} of a trainer GPU goes to "
                "vLLM)"
            )


def apply_placement(cfg: RunConfig, visible: list[int] | None = None) -> Placement:
    """Plan ``cfg`` on this host's devices (default :func:`visible_devices`) and resolve it into ``cfg``.

    Raises:
        ConfigError: as :func:`plan_placement` and :func:`visible_devices`.
    """
    plan = plan_placement(cfg, visible_devices() if visible is None else visible)
    plan.resolve(cfg)
    return plan
