"""The paper model of docs/scaling.md: bus traffic, bus headroom and weight-sync time of an rlbus
run with a 7B or 70B policy on 64-1024 GPUs, from public throughputs (`bench/scaling_inputs.py`).

    PYTHONPATH=$PWD .venv/bin/python -m bench.scaling_model > /tmp/tables.md

prints every table of docs/scaling.md. Pure arithmetic, except that message sizes are measured by
encoding real rlbus messages (`bus.codec.encode` of `Prompt`, `RolloutGroup`, `ScoredGroup`,
`MicroBatch` with the workload's shapes) plus the delivery envelope, so they follow the wire format.

Model (invariants the tests check):
- GPUs split between inference and training so that the producers' completion tokens/s equal what
  the trainer consumes (steady state of the asynchronous pipeline; nobody waits): with generation
  rate g and training rate t per GPU, P prompt and L completion tokens per sample, the inference
  fraction is f = t L/(P+L) / (g + t L/(P+L)), rounded to whole vLLM replicas.
- Every data topic carries one message per group (prompts, rollouts, scored) or per micro-batch
  (batches); messages/s and bytes/s are linear in the number of GPUs (up to replica rounding).
- Weight sync by NCCL is never faster than payload / link bandwidth (nccl-tests: a broadcast's
  time is S / B whatever the rank count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.scaling_inputs import (
    BUCKET_BYTES,
    BUS_STREAM,
    FS_AGGREGATE_READ,
    FS_WRITE,
    FSYNC_S,
    GPU_COUNTS,
    HEADROOM_MIN,
    HEARTBEAT_S,
    HOP_POINTS,
    HUB_CACHE_PRODUCERS,
    IB_PER_GPU,
    NCCL_EFFICIENCY,
    POLICIES,
    REWARD_BUSY,
    WIRE_DTYPE_BYTES,
    WORKLOADS,
    Policy,
    Workload,
)
from bus.codec import encode
from bus.envelope import envelope
from bus.messages import MicroBatch, Prompt, RolloutGroup, ScoredGroup, WeightsApplied

DATA_TOPICS = ("prompts", "rollouts", "scored", "batches")


def _nbytes(msg) -> int:
    """Bytes of one data message on the wire: the `D` envelope + header + array frames."""
    frames = encode(msg)
    return len(envelope("D", "0" * 16, msg.id)) + sum(memoryview(f).nbytes for f in frames)


def message_sizes(w: Workload) -> dict[str, int]:
    """Bytes per message of each topic for workload `w`, measured by encoding real messages.

    Returns:
        `{"prompts", "rollouts", "scored", "batches", "control"}` -> bytes (control: one
        `weights.applied`, the most frequent control message).
    """
    gid, g, p, n = "f" * 32, w.group_size, w.prompt_tokens, w.group_size * w.completion_tokens
    text = "x" * int(w.completion_tokens * w.chars_per_token)
    ptext = "x" * int(p * w.chars_per_token)
    prompt = Prompt(
        id=gid, index=0, step=0, task="gsm8k", messages=[{"role": "user", "content": ptext}], info={"answer": "42"}
    )
    lens = np.full(g, w.completion_tokens, np.int32)
    versions = np.zeros(g, np.int64)
    spans = np.stack([versions, lens.astype(np.int64)], axis=1)
    group = dict(
        id=gid,
        prompt_index=0,
        step=0,
        task="gsm8k",
        info={"answer": "42"},
        producer="producer-0",
        completion_texts=[text] * g,
        finish_reasons=["stop"] * g,
        gen_time_s=1.0,
        prompt_ids=np.zeros(p, np.int32),
        completion_ids=np.zeros(n, np.int32),
        completion_lens=lens,
        sampler_logprobs=np.zeros(n, np.float32),
        version_start=versions,
        version_end=versions,
        prompt_text=ptext,
        version_spans=spans,
        version_span_counts=np.ones(g, np.int32),
    )
    rollout = RolloutGroup(**group)
    scored = ScoredGroup(
        **group,
        reward_worker="rewards-0",
        rewards=np.zeros(g, np.float32),
        advantages=np.zeros(g, np.float32),
        reward_terms={"correct": [0.0] * g},
    )
    t = w.micro_batch_tokens
    s = max(1, t // (p + w.completion_tokens))
    seq = np.full(s, t // s, np.int32)
    seq[-1] += t - int(seq.sum())
    mb = MicroBatch(
        id="0:0",
        step=0,
        micro_index=0,
        num_micro_batches=1,
        step_loss_tokens=t,
        step_samples=s,
        sample_ids=[f"{gid}/{j}" for j in range(s)],
        input_ids=np.zeros(t, np.int32),
        seq_lens=seq,
        loss_mask=np.ones(t, bool),
        sampler_logprobs=np.zeros(t, np.float32),
        advantages=np.zeros(t, np.float32),
        rewards=np.zeros(s, np.float32),
        oldest_versions=np.zeros(s, np.int64),
        teacher_logprobs=np.zeros(0, np.float32),
        token_versions=np.zeros(t, np.int64),
        reward_terms={"correct": [0.0] * s},
    )
    applied = WeightsApplied(id=gid, producer="producer-1023", version=1000, apply_time_s=1.0)
    return {
        "prompts": _nbytes(prompt),
        "rollouts": _nbytes(rollout),
        "scored": _nbytes(scored),
        "batches": _nbytes(mb),
        "control": sum(memoryview(f).nbytes for f in encode(applied)),
    }


@dataclass(frozen=True)
class Config:
    """One (policy, workload, GPU count) point and its derived sizes.

    Attributes: gen_gpus / train_gpus: the split; replicas: vLLM engines (= producers);
    reward_workers; completion_tok_s: produced completion tokens/s; groups_s: groups/s on every
    group topic; batches_s: micro-batches/s; step_s: seconds per optimizer step;
    components: processes on the control channel.
    """

    policy: Policy
    workload: Workload
    gpus: int
    gen_gpus: int
    train_gpus: int
    replicas: int
    reward_workers: int
    completion_tok_s: float
    groups_s: float
    batches_s: float
    step_s: float
    components: int


def configure(policy: Policy, w: Workload, gpus: int) -> Config:
    """Split `gpus` (see the module docstring) and derive the rates.

    Raises:
        ValueError: fewer GPUs than one vLLM replica plus one training GPU.
    """
    if gpus < policy.tp + 1:
        raise ValueError(f"gpus={gpus} cannot hold one {policy.tp}-GPU replica and a trainer")
    frac = w.completion_tokens / (w.prompt_tokens + w.completion_tokens)
    g, t = policy.gen_tok_s.value, policy.train_tok_s.value * frac
    replicas = min(max(1, round(gpus * t / (g + t) / policy.tp)), (gpus - 1) // policy.tp)
    gen_gpus = replicas * policy.tp
    train_gpus = gpus - gen_gpus
    produced = gen_gpus * g
    consumed = train_gpus * t  # completion tokens/s the trainer can take
    completion_tok_s = min(produced, consumed)
    groups_s = completion_tok_s / (w.group_size * w.completion_tokens)
    tokens_s = groups_s * w.group_size * (w.prompt_tokens + w.completion_tokens)
    rewards = max(1, math.ceil(groups_s * w.reward_s_per_group / REWARD_BUSY))
    step_tokens = w.prompts_per_step * w.group_size * (w.prompt_tokens + w.completion_tokens)
    return Config(
        policy,
        w,
        gpus,
        gen_gpus,
        train_gpus,
        replicas,
        rewards,
        completion_tok_s,
        groups_s,
        tokens_s / w.micro_batch_tokens,
        step_tokens / tokens_s,
        replicas + rewards + 4,
    )


def topic_rates(c: Config, sizes: dict[str, int]) -> dict[str, tuple[float, float]]:
    """`{topic: (messages/s, bytes/s)}` summed over the topic's links; `control` counts the
    hub's egress (each publish goes to every subscriber: all components subscribe to everything)."""
    per_step = c.replicas + 4  # weights.applied per producer; weights.ready, trainer.step, groups.trained, eval
    control = per_step / c.step_s * c.components
    rates = {"prompts": c.groups_s, "rollouts": c.groups_s, "scored": c.groups_s, "batches": c.batches_s}
    out = {k: (v, v * sizes[k]) for k, v in rates.items()}
    out["control"] = (control, control * sizes["control"])
    return out


def hop_capacity(size: int) -> float:
    """Messages/s one ZeroMQ hop moves at message `size` bytes: log-log interpolation of
    `HOP_POINTS` (bytes/s), flat outside their range."""
    xs = [math.log(s) for s, _ in HOP_POINTS]
    ys = [math.log(b) for _, b in HOP_POINTS]
    x = min(max(math.log(size), xs[0]), xs[-1])
    return math.exp(float(np.interp(x, xs, ys))) / size


def headroom(c: Config, sizes: dict[str, int]) -> dict[str, float]:
    """Capacity / load at the busiest endpoint of each hop (x; >1 means it keeps up).

    Endpoints: prompt source (sends every prompt), one reward worker (its share of rollouts), the
    packer (receives every scored group; also bounded by one spool fsync per group: the bound
    when every group arrives alone, a floor since the packer's group commit), trainer rank
    0 (receives every micro-batch), hub egress (control fan-out).
    """
    rates = topic_rates(c, sizes)
    load = {
        "prompt source": (rates["prompts"][0], sizes["prompts"]),
        "reward worker": (rates["rollouts"][0] / c.reward_workers, sizes["rollouts"]),
        "packer": (rates["scored"][0], sizes["scored"]),
        "trainer rank 0": (rates["batches"][0], sizes["batches"]),
        "hub egress": (rates["control"][0], sizes["control"]),
    }
    out = {k: hop_capacity(size) / msgs for k, (msgs, size) in load.items()}
    out["packer fsync"] = 1.0 / FSYNC_S.value / rates["scored"][0]
    return out


def weight_sync(c: Config) -> dict[str, float]:
    """Seconds to move one full bf16 policy to every producer, by method (see docs/scaling.md).

    Keys: `payload_GB`, `buckets`, `nccl_bound` (S/B), `nccl` (S/(eta B)), `fsdp_gather` (the
    trainer's all-gather of the sharded weights, S (n-1)/(n eta B)), `fs_<R>` (one writer, then
    every replica reads S from a shared file system of aggregate read bandwidth R), `bus_star`
    (the trainer sends S to each replica over its NIC), `bus_tree` (replicas relay over tcp streams
    in a pipelined tree, bounded by one stream's measured bandwidth).
    """
    s = c.policy.params * WIRE_DTYPE_BYTES
    b = IB_PER_GPU.value
    n = c.train_gpus
    out = {
        "payload_GB": s / 1e9,
        "buckets": math.ceil(s / BUCKET_BYTES),
        "nccl_bound": s / b,
        "nccl": s / (NCCL_EFFICIENCY * b),
        "fsdp_gather": s * (n - 1) / n / (NCCL_EFFICIENCY * b) if n > 1 else 0.0,
    }
    for r in FS_AGGREGATE_READ:
        out[f"fs_{r / 1e9:.0f}"] = s / FS_WRITE.value + max(s / FS_WRITE.value, c.replicas * s / r)
    out["bus_star"] = max(c.replicas * s / (NCCL_EFFICIENCY * b), s / BUS_STREAM.value)
    depth = math.ceil(math.log(c.replicas + 1, 4))  # fan-out 4 per relay
    chunk = BUCKET_BYTES
    out["bus_tree"] = s / BUS_STREAM.value + depth * chunk / BUS_STREAM.value
    return out


# ------------------------------------------------------------------------------------------------
# Tables (markdown), as in docs/scaling.md
# ------------------------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _si(x: float) -> str:
    """3 significant digits with k/M/G suffixes (`1.23k`)."""
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.3g}"


def links_table(policy: Policy, w: Workload) -> str:
    """Split, rates, step time and delivery links per GPU count (`*`: more producers than the hub's
    last-value cache keeps `weights.applied` slots for)."""
    rows = []
    for gpus in GPU_COUNTS:
        c = configure(policy, w, gpus)
        links = c.replicas * c.reward_workers + 2 * c.replicas + c.reward_workers + 3
        cache = "" if c.replicas <= HUB_CACHE_PRODUCERS else "*"
        rows.append(
            [
                str(gpus),
                f"{c.gen_gpus} ({c.replicas}){cache}",
                str(c.train_gpus),
                str(c.reward_workers),
                _si(c.completion_tok_s),
                f"{c.groups_s:.3g}",
                f"{c.step_s:.3g}",
                _si(links),
                _si(2 * links / HEARTBEAT_S),
            ]
        )
    return _table(
        [
            "GPUs",
            "inference GPUs (producers)",
            "training GPUs",
            "reward workers",
            "completion tok/s",
            "groups/s",
            "step s",
            "data-topic links",
            "heartbeats/s",
        ],
        rows,
    )


def traffic_table(policy: Policy, w: Workload) -> str:
    """Messages/s and MB/s per topic per GPU count."""
    sizes = message_sizes(w)
    rows = []
    for gpus in GPU_COUNTS:
        r = topic_rates(configure(policy, w, gpus), sizes)
        rows.append([str(gpus)] + [f"{_si(r[t][0])} / {r[t][1] / 1e6:.3g}" for t in (*DATA_TOPICS, "control")])
    return _table(["GPUs", *(f"{t} msg/s / MB/s" for t in DATA_TOPICS), "control (hub egress) msg/s / MB/s"], rows)


def headroom_table(policy: Policy, w: Workload) -> str:
    """Headroom (x) of the busiest endpoint of each hop; `**` marks < HEADROOM_MIN."""
    sizes = message_sizes(w)
    rows, head = [], None
    for gpus in GPU_COUNTS:
        h = headroom(configure(policy, w, gpus), sizes)
        head = head or list(h)
        rows.append([str(gpus)] + [(f"**{v:.3g}**" if v < HEADROOM_MIN else f"{v:.3g}") for v in h.values()])
    return _table(["GPUs", *head], rows)


def sync_table(policy: Policy, w: Workload) -> str:
    """Weight-sync seconds per method per GPU count, next to the step time."""
    rows = []
    fs_keys = [f"fs_{r / 1e9:.0f}" for r in FS_AGGREGATE_READ]
    for gpus in GPU_COUNTS:
        c = configure(policy, w, gpus)
        s = weight_sync(c)
        rows.append(
            [
                str(gpus),
                f"{s['payload_GB']:.3g}",
                str(s["buckets"]),
                f"{s['nccl_bound']:.3g}",
                f"{s['nccl']:.3g}",
                f"{s['fsdp_gather']:.3g}",
                *(f"{s[k]:.3g}" for k in fs_keys),
                f"{s['bus_star']:.3g}",
                f"{s['bus_tree']:.3g}",
                f"{c.step_s:.3g}",
            ]
        )
    return _table(
        [
            "GPUs",
            "payload GB",
            "32 MiB buckets",
            "NCCL S/B",
            "NCCL est.",
            "FSDP gather",
            *(f"filesystem ({k[3:]} GB/s)" for k in fs_keys),
            "bus star",
            "bus tree (x4)",
            "step s",
        ],
        rows,
    )


def sizes_table() -> str:
    """Bytes per message of each topic, per workload."""
    rows = []
    for w in WORKLOADS:
        s = message_sizes(w)
        per_tok = s["rollouts"] / (w.group_size * w.completion_tokens)
        rows.append(
            [
                w.name,
                f"P={w.prompt_tokens} L={w.completion_tokens} G={w.group_size}",
                *(_si(s[t]) for t in (*DATA_TOPICS, "control")),
                f"{per_tok:.3g}",
            ]
        )
    return _table(
        ["workload", "shape", *(f"{t} B" for t in DATA_TOPICS), "weights.applied B", "rollout B per completion token"],
        rows,
    )


def main() -> None:
    """Print every table of docs/scaling.md."""
    print("## Message sizes\n\n" + sizes_table())
    for policy in POLICIES:
        for w in WORKLOADS:
            print(f"\n## {policy.name}, workload {w.name}\n")
            print(links_table(policy, w) + "\n")
            print(traffic_table(policy, w) + "\n")
            print(headroom_table(policy, w))
        print(f"\n## {policy.name}: weight sync (s)\n\n" + sync_table(policy, WORKLOADS[0]))


if __name__ == "__main__":
    main()
