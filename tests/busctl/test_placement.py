"""The device plan of a run (:mod:`busctl.components.placement`), its refusals, and its use by ``busctl up``.

The plans are computed for 0, 1, 2 and 8 visible devices from real configs (``load_config`` with
overrides); ``busctl up --dry-run`` runs as a real subprocess with busctl's own
``CUDA_VISIBLE_DEVICES`` saying which devices it sees (no GPU needed: the plan is pure, and the
dry run starts nothing). A real supervisor over real processes (``tests/busctl/sleepy.py``) in
the roles of the trainer and a producer shows each process gets its ``CUDA_VISIBLE_DEVICES``
(read from ``/proc/PID/environ``), and ``busctl scale`` refusing a producer with no device left.
The trainer's side (:func:`trainer.parallel.device.trainer_device`) is checked on this CPU host.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from busctl import cli as busctl
from busctl.components.placement import Placement, apply_placement, plan_placement, visible_devices
from configs.schema import ConfigError, load_config
from producers.engine import device_engine_args
from test_supervisor import make_cfg, table

REPO = Path(__file__).resolve().parents[2]


def plan(visible: list[int], *overrides: str) -> Placement:
    return plan_placement(load_config(None, list(overrides)), visible)


def refused(visible: list[int], *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        plan(visible, *overrides)
    return str(err.value)


# -- plans -------------------------------------------------------------------------------------------


def test_no_visible_device_puts_everything_on_cpu():
    p = plan([], "producers.replicas=2")
    assert (p.trainer_device, p.trainer_gpus, p.producer_dtype) == ("cpu", (), "float32")
    assert p.producer_gpus == ((),) * 8 and not p.producers_on_gpu
    for role, index in [
        ("trainer", 0),
        ("producer", 1),
        ("producer", 7),
        ("hub", 0),
        ("rewards", 3),
        ("prompt-source", 0),
    ]:
        assert p.environ(role, index) == {"CUDA_VISIBLE_DEVICES": ""}
    p.check_producers(8)  # busctl scale may use every index
    assert p.broadcast_backend == "gloo"


def test_trainer_cuda_without_devices_is_a_config_error():
    msg = refused([], "trainer.device=cuda")
    assert "trainer.device is cuda but no CUDA device is visible" in msg and "trainer.device: cpu" in msg
    assert "trainer.gpus [0] but no CUDA device is visible" in refused([], "trainer.gpus=[0]")
    assert "trainer.dp_backend nccl" in refused([], "trainer.data_parallel=2", "trainer.dp_backend=nccl")


def test_one_gpu_is_refused_unless_shared():
    msg = refused([0])
    assert "2 GPUs needed (trainer 1 + producers 1 x 1), 1 visible: [0]" in msg
    assert "producers.share_gpus_with_trainer: true" in msg and "producers.gpus_per_replica: 0" in msg

    shared = plan(
        [0], "producers.share_gpus_with_trainer=true", "producers.replicas=2", "producers.gpu_memory_utilization=0.35"
    )
    assert (shared.trainer_device, shared.trainer_gpus, shared.producer_dtype) == ("cuda", (0,), "bfloat16")
    assert shared.producer_gpus == ((0,),) * 8
    assert shared.environ("producer", 1) == shared.environ("trainer") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert shared.environ("packer") == {"CUDA_VISIBLE_DEVICES": ""}
    assert shared.broadcast_backend == "gloo"  # NCCL refuses two ranks on one GPU
    msg = refused([0], "producers.share_gpus_with_trainer=true", "broadcast.backend=nccl")
    assert "broadcast.backend nccl" in msg and "NCCL cannot put two ranks on one GPU" in msg
    assert "broadcast.method: filesystem" in msg
    assert (
        plan(
            [0],
            "producers.share_gpus_with_trainer=true",
            "broadcast.method=filesystem",
            "producers.gpu_memory_utilization=0.3",
        ).broadcast_backend
        == "auto"
    )


def test_one_gpu_for_the_trainer_with_producers_on_cpu_and_the_reverse():
    cpu_producers = plan([0], "producers.gpus_per_replica=0")
    assert (cpu_producers.trainer_gpus, cpu_producers.producer_gpus[0], cpu_producers.producer_dtype) == (
        (0,),
        (),
        "float32",
    )
    cpu_trainer = plan([0], "trainer.device=cpu")
    assert (cpu_trainer.trainer_device, cpu_trainer.trainer_gpus) == ("cpu", ())
    assert cpu_trainer.producer_gpus[0] == (0,) and cpu_trainer.producer_dtype == "bfloat16"
    assert cpu_trainer.producer_gpus[1] is None  # a second producer would need a second GPU
    assert plan([0], "trainer.device=cpu", "producers.dtype=float32").producer_dtype == "float32"  # asked, kept
    # the broadcast group mixes CPU and CUDA members: gloo, and an explicit nccl is refused
    assert cpu_producers.broadcast_backend == cpu_trainer.broadcast_backend == "gloo"
    assert "a member is not on CUDA" in refused([0], "producers.gpus_per_replica=0", "broadcast.backend=nccl")


def test_two_gpus_one_trainer_one_producer_and_scaling_refused():
    p = plan([0, 1])
    assert (p.trainer_device, p.trainer_gpus, p.producer_gpus[0], p.broadcast_backend) == ("cuda", (0,), (1,), "nccl")
    assert p.producer_gpus[1:] == (None,) * 7
    p.check_producers(1)
    with pytest.raises(ConfigError, match=r"producers=2 does not fit the GPUs: 3 GPUs needed .*2 visible: \[0, 1\]"):
        p.check_producers(2)
    with pytest.raises(ValueError, match="producer-1 has no devices"):
        p.environ("producer", 1)
    assert plan([0, 1], "trainer.gpus=[1]").producer_gpus[0] == (0,)
    assert "3 GPUs needed (trainer 1 + producers 2 x 1), 2 visible: [0, 1]" in refused([0, 1], "producers.replicas=2")


def test_two_gpus_trainer_keys_that_do_not_fit():
    assert "trainer.gpus [3]: [3] not among the CUDA devices visible to busctl: [0, 1]" in refused(
        [0, 1], "trainer.gpus=[3]"
    )
    msg = refused([0, 1], "trainer.data_parallel=3")
    assert "trainer.data_parallel=3 ranks need 3 GPUs (one each), 2 visible: [0, 1]" in msg
    assert "trainer.dp_backend gloo" in refused([0, 1], "trainer.data_parallel=2", "trainer.dp_backend=gloo")
    msg = refused([0, 1], "trainer.data_parallel=2", "producers.tensor_parallel_size=2", "producers.gpus_per_replica=2")
    assert "4 GPUs needed (trainer 2 + producers 1 x 2), 2 visible: [0, 1]" in msg


def test_eight_gpus_tensor_parallel_producers_and_an_fsdp_trainer():
    p = plan(
        list(range(8)),
        "producers.replicas=2",
        "producers.tensor_parallel_size=2",
        "producers.gpus_per_replica=2",
        "trainer.data_parallel=4",
        "trainer.parallel=fsdp",
    )
    assert p.trainer_gpus == (0, 1, 2, 3) and p.environ("trainer") == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert p.producer_gpus[:2] == ((4, 5), (6, 7)) and p.environ("producer", 1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert p.broadcast_backend == "nccl"
    with pytest.raises(ConfigError, match=r"10 GPUs needed \(trainer 4 \+ producers 3 x 2\), 8 visible"):
        p.check_producers(3)

    single = plan(list(range(8)), "producers.replicas=4")  # scaled producers take the devices left
    assert single.producer_gpus == ((1,), (2,), (3,), (4,), (5,), (6,), (7,), None)
    single.check_producers(7)
    with pytest.raises(ConfigError, match="producers=8"):
        single.check_producers(8)

    shared = plan(
        list(range(8)),
        "producers.tensor_parallel_size=2",
        "producers.gpus_per_replica=2",
        "producers.share_gpus_with_trainer=true",
        "producers.replicas=4",
        "producers.gpu_memory_utilization=0.5",
    )
    # round-robin over every device, the trainer's last: a producer shares device 0 only when it must
    assert shared.producer_gpus[:5] == ((1, 2), (3, 4), (5, 6), (7, 0), (1, 2))
    assert "needs 3 distinct GPUs, 2 visible" in refused(
        [0, 1],
        "producers.tensor_parallel_size=3",
        "producers.gpus_per_replica=3",
        "producers.share_gpus_with_trainer=true",
    )


def test_resolved_values_are_written_into_the_config():
    cfg = load_config(None, [])
    assert (cfg.trainer.device, cfg.producers.dtype, cfg.broadcast.backend) == ("auto", "auto", "auto")
    p = apply_placement(cfg, [0, 1])
    assert (cfg.trainer.device, cfg.producers.dtype, cfg.broadcast.backend) == ("cuda", "bfloat16", "nccl")
    assert (p.trainer_device, p.producer_dtype, p.broadcast_backend) == ("cuda", "bfloat16", "nccl")
    again = load_config(None, ["trainer.device=cuda", "producers.dtype=bfloat16", "broadcast.backend=nccl"])
    assert plan_placement(again, [0, 1]) == p  # the saved config plans the same on resume


# -- visible devices ---------------------------------------------------------------------------------


def test_visible_devices_honours_busctls_own_cuda_visible_devices():
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": " 2, 3 "}) == [2, 3]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == [1]  # as CUDA: a negative entry ends the list
    with pytest.raises(ConfigError, match="give indices"):
        visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-5c1c3a4e"})


def test_visible_devices_from_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = -L ] || exit 3\n'
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aa)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bb)'\n"
        "echo '  MIG 3g.40gb     Device  0: (UUID: MIG-cc)'\n"
    )
    smi.chmod(0o755)
    assert visible_devices({}, nvidia_smi=str(smi)) == [0, 1]
    failing = tmp_path / "failing-smi"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    assert visible_devices({}, nvidia_smi=str(failing)) == []
    assert visible_devices({}, nvidia_smi=str(tmp_path / "absent")) == []


# -- busctl up --dry-run ------------------------------------------------------------------------------


def dry_run(cuda_visible_devices: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda_visible_devices, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "busctl", "up", "--dry-run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_the_resolved_config_and_the_plan():
    cpu = dry_run("")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    printed = yaml.safe_load(cpu.stdout)  # the plan is in comments: the output stays YAML
    assert (printed["trainer"]["device"], printed["producers"]["dtype"]) == ("cpu", "float32")
    assert "# placement: CUDA devices visible to busctl: []" in cpu.stdout
    assert "#   trainer: cpu, CUDA_VISIBLE_DEVICES=''; weights to the producers over gloo" in cpu.stdout

    two = dry_run("0,1")  # a plan for a 2-GPU host (nothing starts, so no GPU is needed)
    assert two.returncode == 0, two.stdout + two.stderr
    printed = yaml.safe_load(two.stdout)
    assert (printed["trainer"]["device"], printed["producers"]["dtype"]) == ("cuda", "bfloat16")
    assert "#   trainer: cuda, CUDA_VISIBLE_DEVICES='0'; weights to the producers over nccl" in two.stdout
    assert "#   producer-0: cuda, bfloat16, CUDA_VISIBLE_DEVICES='1'" in two.stdout


def test_dry_run_refuses_plans_that_do_not_fit():
    cuda = dry_run("", "trainer.device=cuda")
    assert cuda.returncode == 2
    assert "trainer.device is cuda but no CUDA device is visible" in cuda.stdout + cuda.stderr
    one = dry_run("0")
    assert one.returncode == 2
    assert "2 GPUs needed (trainer 1 + producers 1 x 1), 1 visible: [0]" in one.stdout + one.stderr


# -- the supervisor spawns each component with its devices -------------------------------------------


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)


def test_supervisor_gives_each_component_its_devices(tmp_path, monkeypatch, capsys):
    """busctl sees devices 0 and 1 (its own CUDA_VISIBLE_DEVICES): the trainer gets 0, the
    producer 1, every other component none; a second producer has no device left, so
    ``busctl scale producers=2`` is refused naming the keys. The processes use no GPU."""
    from test_supervisor import RunningSupervisor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    run = RunningSupervisor(
        make_cfg(tmp_path / "run", "producers.max_replicas=2"), table("hub", "trainer", "rewards-0", "producer-0")
    )
    try:
        comps = run.all_running()
        seen = {name: environ_of(row["pid"]).get("CUDA_VISIBLE_DEVICES") for name, row in comps.items()}
        assert seen == {"hub": "", "trainer": "0", "rewards-0": "", "producer-0": "1"}
        saved = load_config(run.run_dir / "config.yaml")
        assert (saved.trainer.device, saved.producers.dtype) == ("cuda", "bfloat16")

        capsys.readouterr()
        assert busctl.main(["scale", str(run.run_dir), "producers=2"]) == 2
        out = capsys.readouterr().err  # errors go to stderr
        assert "producers=2 does not fit the GPUs" in out and "2 visible: [0, 1]" in out
        assert sorted(run.components()) == ["hub", "producer-0", "rewards-0", "trainer"]
    finally:
        run.close()


# -- the trainer and producer sides ------------------------------------------------------------------


def test_trainer_device_on_this_cpu_host():
    torch = pytest.importorskip("torch")
    from trainer.parallel.device import trainer_device

    if torch.cuda.is_available():
        pytest.skip("checks the CPU host's answers; CUDA is visible here")
    assert trainer_device(load_config(None, ["trainer.device=cpu"]), None) == torch.device("cpu")
    assert trainer_device(load_config(None, []), None) == torch.device("cpu")  # auto, no CUDA
    with pytest.raises(ValueError, match="trainer.device is cuda but torch sees no CUDA device"):
        trainer_device(load_config(None, ["trainer.device=cuda"]), None)
    from trainer.parallel.distributed import DataParallel

    rank = DataParallel(
        rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo"
    )  # no group needed
    assert trainer_device(load_config(None, ["trainer.data_parallel=2"]), rank) == torch.device("cpu")


def test_producer_engine_args_per_device():
    assert device_engine_args(
        on_gpu=False, kv_cache_bytes=2**30, tensor_parallel_size=1, gpu_memory_utilization=0.4
    ) == {"kv_cache_memory_bytes": 2**30, "enable_chunked_prefill": False}
    assert device_engine_args(
        on_gpu=True, kv_cache_bytes=2**30, tensor_parallel_size=2, gpu_memory_utilization=0.4
    ) == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.4}
    assert device_engine_args(on_gpu=True, kv_cache_bytes=2**30) == {
        "tensor_parallel_size": 1,
        "kv_cache_memory_bytes": 2**30,
    }
    for bad in [{"tensor_parallel_size": 0}, {"gpu_memory_utilization": 1.5}]:
        with pytest.raises(ValueError):
            device_engine_args(on_gpu=True, kv_cache_bytes=1, **bad)
