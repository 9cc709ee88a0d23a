"""Inputs of the paper model (`bench/scaling_model.py`): every public or measured number it uses,
each with its source, and the assumptions that have no source (named as such).

Invariants: every `Cited` carries a non-empty `source` (a URL, or a path in this repository or in
`../shared/notes/`); numbers are in SI units named by the field (tokens/s per GPU, bytes/s,
seconds). Nothing here computes; `bench/scaling_model.py` does the arithmetic, `docs/scaling.md`
shows the tables it prints.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Cited:
    """One number and where it comes from.

    Attributes:
        value: the number, in the unit named by the constant that holds it.
        source: a URL, or a repository path (measured here), never empty.
        note: what exactly was measured (model, hardware, batch, version).
    """

    value: float
    source: str
    note: str


@dataclass(frozen=True)
class Policy:
    """A policy size with its public throughputs.

    Attributes:
        name: label in the tables. params: parameter count.
        gen_tok_s: vLLM output tokens/s per inference GPU (Cited).
        train_tok_s: trainer tokens/s per training GPU (prompt + completion tokens, Cited).
        tp: GPUs per vLLM replica (tensor parallel size of the cited measurement): one rlbus producer.
    """

    name: str
    params: float
    gen_tok_s: Cited
    train_tok_s: Cited
    tp: int


@dataclass(frozen=True)
class Workload:
    """What one optimizer step consumes (GRPO groups).

    Attributes:
        name: label. prompt_tokens: P per prompt. completion_tokens: mean L per completion.
        group_size: G completions per prompt. prompts_per_step: groups per optimizer step.
        micro_batch_tokens: `packer.micro_batch_tokens` (tokens per `MicroBatch`).
        chars_per_token: characters of decoded text per token (texts travel with the ids).
        reward_s_per_group: reward-worker seconds to score one group.
    """

    name: str
    prompt_tokens: int
    completion_tokens: int
    group_size: int
    prompts_per_step: int
    micro_batch_tokens: int
    chars_per_token: float = 4.0
    reward_s_per_group: float = 0.5


LAMBDA_VLLM = "https://github.com/LambdaLabsML/vllm-benchmark/blob/main/benchmark_v0.md"
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
NCCL_PERF = "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"
BUS_NOTES = "../shared/notes/bus-measurements.md"

POLICIES = (
    Policy(
        "7B",
        7.6e9,
        Cited(
            8088.35,
            LAMBDA_VLLM,
            "Llama 3.1 8B bf16, vLLM v0.6.0, 1x H100 SXM, tp=1, 256 seqs, max-seq-len 2048, "
            "num-scheduler-steps 10: 8,088 output tokens/s",
        ),
        Cited(
            5605.0,
            TORCHTITAN,
            "Llama 3.1 8B, FSDP2 bf16 (no compile, no Float8), 128 H100, selective AC: 5,605 TPS/GPU",
        ),
        tp=1,
    ),
    Policy(
        "70B",
        70.6e9,
        Cited(
            3542.88 / 4,
            LAMBDA_VLLM,
            "Llama 3.1 70B bf16, vLLM v0.6.0, 4x H100 SXM, tp=4, 256 seqs, max-seq-len 2048, "
            "num-scheduler-steps 10: 3,543 output tokens/s = 886 per GPU",
        ),
        Cited(
            829.0, TORCHTITAN, "Llama 3.1 70B, FSDP 32 x TP 8 + torch.compile + Float8, 256 H100, full AC: 829 TPS/GPU"
        ),
        tp=4,
    ),
)

WORKLOADS = (
    # Reasoning RL: completions lognormal around 1-4k tokens (issue 19), G = 16.
    Workload(
        "reasoning",
        prompt_tokens=512,
        completion_tokens=2048,
        group_size=16,
        prompts_per_step=256,
        micro_batch_tokens=16384,
    ),
    # The message-rate worst case: short answers, small groups (8x the groups per token).
    Workload(
        "short",
        prompt_tokens=256,
        completion_tokens=256,
        group_size=8,
        prompts_per_step=1024,
        micro_batch_tokens=16384,
        reward_s_per_group=0.05,
    ),
)

GPU_COUNTS = (64, 128, 256, 512, 1024)

IB_PER_GPU = Cited(
    400e9 / 8, TORCHTITAN, "Grand Teton hosts: backend RDMA network with 400 Gb/s per GPU (= 50 GB/s line rate)"
)
NCCL_EFFICIENCY = 0.8
"""Assumption (no source): achieved / line-rate bandwidth of a large NCCL broadcast or all-gather."""
BROADCAST_FORMULA = Cited(
    1.0,
    NCCL_PERF,
    "broadcast: all data leaves the root, t = S / B whatever the rank count; all-gather: t = S (n-1) / (n B)",
)

BUCKET_BYTES = 32 * 1024 * 1024
"""`broadcaster.manifest.DEFAULT_BUCKET_BYTES` (a test checks they agree; not imported: it needs torch)."""

WIRE_DTYPE_BYTES = 2
"""`producers.dtype: bfloat16` on GPU producers: the weights travel as bf16."""

HOP_POINTS = (
    # (message bytes, bytes/s of one ZeroMQ hop in rlbus's wire format), BUS_NOTES row
    # "msgpack header + raw array frames, copy=False": 71k msgs/s at 1 KiB and 1.18 GB/s at
    # 64 KiB (ipc: tcp was not measured at those sizes), 4.5 GB/s at 1 MiB and 3.2 GB/s at 8 MiB (tcp).
    (1024, 71e3 * 1024),
    (64 * 1024, 1.18 * GB),
    (1 << 20, 4.5 * GB),
    (8 << 20, 3.2 * GB),
)
HOP_SOURCE = Cited(
    71e3,
    BUS_NOTES,
    "raw pyzmq, 2 processes on a 2-core host, no delivery protocol (credit, acks): an upper bound for one rlbus hop",
)
BUS_STREAM = Cited(3.2 * GB, BUS_NOTES, "one tcp stream, 8 MiB messages, msgpack header + raw frames, copy=False")

FSYNC_S = Cited(
    0.54e-3,
    "measured for docs/scaling.md (one-off probe, see its 'Packer' section)",
    "median append + fsync of 400 KB on this 2-core VM's ext4 disk (4 KB: 0.31 ms)",
)

FS_WRITE = Cited(3.0 * GB, BUS_NOTES, "file write + rename + read, ext4 /tmp, 1 MiB messages: ~3 GB/s (one stream)")
FS_AGGREGATE_READ = (20 * GB, 200 * GB)
"""Assumption (no source): aggregate read bandwidth of a shared file system; both values are tabulated."""

REWARD_BUSY = 0.7
"""Assumption: reward workers are provisioned to be at most 70% busy."""
HEARTBEAT_S = 0.5
"""`bus.heartbeat_s` default (configs/schema.py)."""
HUB_CACHE_PRODUCERS = 4096
"""`bus.hub.MAX_CACHED_PRODUCERS`: weights.applied slots the hub's last-value cache keeps."""
HEADROOM_MIN = 10.0
"""A hop with less headroom than this at some size is marked for sharding."""
