"""Seeded generators of hostile rlbus messages: every one is invalid for the receiver under test.

Two layers: :class:`HostileMessages` (message frames, for any receiver of :mod:`bus.messages`) and
:class:`HostileEnvelopes` (whole frame sets of the delivery protocol, :mod:`bus.envelope`, for a
data topic's inbox or outbox socket; see its docstring).

``HostileMessages(seed, accept)`` yields multipart messages (lists of ``bytes`` frames) built
from realistic valid encodings of every type in :data:`bus.registry.MESSAGE_TYPES`, broken in
one of many ways (see :data:`MUTATIONS`):

- random bytes; truncated, bit-flipped or over-long header frames; header frames over the size
  limit; missing, extra, duplicated, swapped, truncated, extended or random array frames;
- header edits: wrong / missing / non-integer / bool schema, unknown / non-string / missing
  type, retyping a message as another type, missing fields, wrong field types (bool for int,
  None, bytes, NaN, nested junk, lists with wrong element types), msgpack ext types (zero-length
  ones included), deep nesting, non-string map keys, invalid UTF-8, non-map headers, huge
  str / bin / array / map / ext length prefixes followed by a few bytes;
- array descriptors: junk ``arrays`` values, too many entries, missing / extra keys, unknown,
  repeated or non-string names, bad dtype names, huge (``2**40``, ``2**64 - 1``), negative,
  float, bool or wrong-rank shapes, shape / dtype / frame-size mismatches;
- cross-field inconsistencies (lengths that do not add up, negative lengths, versions out of
  order, non-finite rewards, micro-batch indices out of range), and stacked edits;
- valid messages of a type the receiver does not ``accept`` (only when ``accept`` is given).

Each candidate is checked with :func:`classify` (``bus.codec.decode`` plus the receiver's
``accept`` tuple) and kept only if the receiver must reject it, so every yielded message has to
be counted in ``rlbus_bus_rejected_total``. ``reasons`` and ``mutations`` count what was yielded.
"""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from collections import Counter
from typing import Any, Callable, Iterator

import msgpack
import numpy as np

from bus.codec import decode, encode
from bus.envelope import MAX_ENVELOPE_BYTES, MAX_ID_CHARS, MAX_IDS_PER_ACK, parse_envelope
from bus.registry import MESSAGE_TYPES
from bus.messages_api import ApiCall, ApiReply
from bus.messages_weights import WeightGroup, WeightGroupAck, WeightsBucket, WeightsRequest
from bus.messages import (
    ComponentHeartbeat,
    ComponentReady,
    GroupsDropped,
    GroupsTrained,
    Message,
    MicroBatch,
    Prompt,
    RolloutGroup,
    RunDone,
    RunFinalStep,
    RunFinish,
    EvalResult,
    ScoredGroup,
    ServersScaled,
    ServersWanted,
    TrainerStep,
    WeightsApplied,
    WeightsWanted,
    WeightsReady,
)
from bus.wire import MAX_ARRAYS, MAX_HEADER_BYTES, SCHEMA_VERSION, WireError

Frames = list[bytes]

# -- realistic valid messages ----------------------------------------------------------------------


def realistic_examples() -> dict[str, Message]:
    """One valid message of every registered type, shaped like those of a small real run
    (reverse_text, groups of 4, completions up to 16 tokens, a tiny policy's manifest)."""
    rng = np.random.default_rng(0)
    lens = np.array([16, 5, 16, 9], np.int32)
    n = int(lens.sum())
    rollout = dict(
        prompt_index=21,
        step=3,
        task="reverse_text",
        info={"target": "olleh", "source": "hello"},
        producer="producer-0",
        completion_texts=["olleholleholleho", "olleh", "hello hello hell", "oll eh ol"],
        finish_reasons=["length", "stop", "length", "stop"],
        gen_time_s=0.84,
        prompt_ids=rng.integers(0, 32_000, 27, dtype=np.int32),
        completion_ids=rng.integers(0, 32_000, n, dtype=np.int32),
        completion_lens=lens,
        sampler_logprobs=-rng.random(n, dtype=np.float32) * 4,
        version_start=np.array([2, 2, 3, 3], np.int64),
        version_end=np.array([3, 2, 3, 3], np.int64),
        version_spans=np.array([[2, lens[0] - 1], [3, 1], [2, lens[1]], [3, lens[2]], [3, lens[3]]], np.int64),
        version_span_counts=np.array([2, 1, 1, 1], np.int32),
        loss_mask=np.arange(n) % 5 != 2,  # every fifth token an environment token
        env_rewards=np.array([0.25, 1.0, 0.0, 0.5], np.float32),
        prompt_messages=[{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello"}],
    )
    seq = np.array([43, 32, 43, 36], np.int32)
    t = int(seq.sum())
    mask = np.zeros(t, bool)
    start = 0
    for s, c in zip(seq, lens):
        mask[start + s - c : start + s] = True
        start += s
    examples: list[Message] = [
        Prompt(
            id="5f0c2a",
            index=21,
            step=3,
            task="reverse_text",
            messages=[{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello"}],
            info={"target": "olleh", "source": "hello"},
        ),
        RolloutGroup(id="5f0c2a", **rollout),
        ScoredGroup(
            id="5f0c2a",
            **rollout,
            reward_worker="rewards-1",
            rewards=np.array([0.25, 1.0, 0.0, 0.5], np.float32),
            advantages=np.array([-0.4, 1.4, -0.9, -0.1], np.float32),
        ),
        MicroBatch(
            id="3:0",
            step=3,
            micro_index=0,
            num_micro_batches=2,
            step_loss_tokens=92,
            step_samples=4,
            sample_ids=["5f0c2a/0", "5f0c2a/1", "5f0c2a/2", "5f0c2a/3"],
            input_ids=rng.integers(0, 32_000, t, dtype=np.int32),
            seq_lens=seq,
            loss_mask=mask,
            sampler_logprobs=np.where(mask, -rng.random(t, dtype=np.float32), 0).astype(np.float32),
            advantages=np.repeat(np.array([-0.4, 1.4, -0.9, -0.1], np.float32), seq),
            rewards=np.array([0.25, 1.0, 0.0, 0.5], np.float32),
            oldest_versions=np.array([2, 2, 3, 3], np.int64),
            teacher_logprobs=np.zeros(0, np.float32),
            token_versions=np.repeat(np.array([2, 2, 3, 3], np.int64), seq),
        ),
        WeightsReady(
            id="w4",
            version=4,
            method="broadcast",
            manifest=[
                ["model.embed_tokens.weight", "bfloat16", [256, 64]],
                ["model.layers.0.self_attn.q_proj.weight", "bfloat16", [64, 64]],
                ["model.norm.weight", "bfloat16", [64]],
            ],
            path="",
            num_bytes=40_064,
        ),
        WeightsApplied(id="a4", producer="producer-0", version=4, apply_time_s=0.031),
        WeightsWanted(id="w5", producer="producer-1", version=5),
        WeightGroup(
            id="g2",
            generation=2,
            host="127.0.0.1",
            port=41_877,
            members=["producer-0", "producer-2"],
            filesystem=["producer-1"],
        ),
        WeightGroupAck(id="k2", producer="producer-2", generation=2),
        WeightsRequest(id="q4", producer="producer-1", version=4, buckets=[2, 3]),
        WeightsBucket(
            id="b4",
            version=4,
            index=2,
            num_buckets=5,
            bucket_bytes=1 << 25,
            crc32=2_850_119_823,
            data=rng.integers(0, 256, 4096, dtype=np.uint8),
        ),
        ApiCall(
            id="c4",
            op="forward_backward",
            model_id="s-9f2:train:0",
            body={"loss_fn": "importance_sampling", "loss_inputs": ["advantages", "logprobs", "target_tokens"]},
            token_ids=rng.integers(0, 258, 12).astype(np.int64),
            datum_lens=np.array([5, 7], dtype=np.int64),
            loss_inputs=rng.normal(size=(3, 12)),
        ),
        ApiReply(
            id="y4",
            call_id="c4",
            ok=False,
            error="loss_fn 'dpo' is not served",
            category="user",
            body={},
        ),
        TrainerStep(id="s4", step=4, version=4, metrics={"loss": -0.012, "reward_mean": 0.44, "kl": 0.0003}),
        GroupsDropped(id="d1", group_ids=["5f0c2a", "77aa01"], reason="stale"),
        GroupsTrained(id="t4", step=4, group_ids=["5f0c2a", "9b1e44", "c03d7f"]),
        RunDone(id="r1", step=4, reason="max_steps"),
        RunFinish(id="f1"),
        RunFinalStep(id="f2", step=41),
        ServersWanted(id="v1", servers=3),
        ServersScaled(id="v2", producer="producer-1", request="v1", servers=3, error=""),
        EvalResult(
            id="e1",
            round=4,
            task="gsm8k",
            version_min=4,
            version_max=5,
            num_samples=32,
            num_failed=0,
            metrics={"reward_mean": 0.125, "pass_at_1": 0.125},
        ),
        ComponentReady(id="c1", name="rewards-1", pid=41_213, metrics_port=38_117, metrics_host="10.0.0.2"),
        ComponentHeartbeat(id="h1", name="rewards-1", pid=41_213, state="running"),
    ]
    out = {m.TYPE: m for m in examples}
    missing = set(MESSAGE_TYPES) - set(out)
    if missing:
        raise AssertionError(f"tests/bus/fuzz.py has no realistic example of {sorted(missing)}: add one")
    return out


# -- the oracle ------------------------------------------------------------------------------------


def classify(frames: Frames, accept: tuple[type[Message], ...] | None) -> str | None:
    """The reject reason a receiving :class:`bus.sockets.BusSocket` with ``accept`` gives
    ``frames``, or None if it would take them. ``"decode"`` means the decoder raised something
    other than :class:`WireError` (a decoder bug; still a reject)."""
    try:
        msg = decode(frames)
    except WireError as exc:
        return exc.reason
    except Exception:
        return "decode"
    if accept is not None and type(msg) not in accept:
        return "unexpected_type"
    return None


# -- building blocks -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Base:
    type_name: str
    msg: Message
    frames: tuple[bytes, ...]
    header: dict[str, Any]  # never mutated: edits copy it
    scalars: tuple[str, ...]  # scalar field names (id included)
    arrays: tuple[str, ...]  # array field names, in frame order


def _pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _map_prefix(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


def _raw_map(items: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already-packed keys and values (to splice in hand-made bytes)."""
    return _map_prefix(len(items)) + b"".join(k + v for k, v in items)


_INT_FIELDS = {
    "index",
    "step",
    "prompt_index",
    "micro_index",
    "num_micro_batches",
    "step_loss_tokens",
    "version",
    "num_bytes",
    "pid",
    "metrics_port",
}

_BAD_DTYPES = [
    "object",
    "O",
    "|O",
    "<i4",
    ">i4",
    "int16",
    "uint32",
    "float16",
    "bfloat16",
    "complex64",
    "V8",
    "S4",
    "U1",
    "",
    "int",
    "float",
    "Int32",
    "int32\x00",
    "int32 ",
    "datetime64[ns]",
    None,
    3,
    True,
    ["int32"],
    {"kind": "i"},
    b"int32",
]
_ALLOWED = ["bool", "uint8", "int32", "int64", "float32", "float64"]


def _deep(depth: int, leaf: Any = 0) -> Any:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"k": out}
    return out


def _junk_values(rng: random.Random) -> list[Any]:
    return [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        1.5,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        "",
        "x" * rng.randint(1, 64),
        "\u202e\x00\ud7ff",
        rng.randbytes(rng.randint(0, 16)),
        [],
        [1, "a", None],
        ["a", ["b"]],
        {},
        {"k": [1, {"z": None}]},
        {"loss": "nan"},
        _deep(rng.randint(2, 60)),
        [[]] * rng.randint(1, 8),
        msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 4))),
    ]


def _huge_prefix(rng: random.Random) -> bytes:
    """A msgpack str/bin/array/map/ext header declaring far more data than follows."""
    big = rng.choice([2**32 - 1, 2**31, 1 << 21, (1 << 20) + 1, 2**24])
    kind = rng.choice(["str32", "bin32", "array32", "map32", "ext32", "str16", "bin16", "array16", "map16"])
    tail = rng.randbytes(rng.randint(0, 8))
    if kind.endswith("16"):
        code = {"str16": b"\xda", "bin16": b"\xc5", "array16": b"\xdc", "map16": b"\xde"}[kind]
        return code + struct.pack(">H", 0xFFFF) + tail
    code = {"str32": b"\xdb", "bin32": b"\xc6", "array32": b"\xdd", "map32": b"\xdf", "ext32": b"\xc9"}[kind]
    return code + struct.pack(">I", big) + (b"\x05" if kind == "ext32" else b"") + tail


# -- the generator ---------------------------------------------------------------------------------


class HostileMessages:
    """An endless, seeded stream of messages that a receiver with ``accept`` must reject.

    Args:
        seed: seeds a private ``random.Random``; the same seed gives the same stream.
        accept: the receiver's ``accept`` tuple (None: it takes every registered type, as the hub).
        examples: valid messages to break, by type name (default :func:`realistic_examples`).

    Attributes:
        reasons: ``Counter`` of the expected reject reason of every yielded message.
        mutations: ``Counter`` of the mutation that made every yielded message.
    """

    def __init__(
        self,
        seed: int,
        accept: tuple[type[Message], ...] | None = None,
        examples: dict[str, Message] | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.accept = accept
        self.reasons: Counter[str] = Counter()
        self.mutations: Counter[str] = Counter()
        examples = examples or realistic_examples()
        self.bases: list[_Base] = []
        for name, msg in sorted(examples.items()):
            frames = tuple(bytes(memoryview(f)) for f in encode(msg))
            header = msgpack.unpackb(frames[0], raw=False)
            arrays = tuple(d["name"] for d in header["arrays"])
            scalars = tuple(k for k in header if k not in ("type", "schema", "arrays"))
            self.bases.append(_Base(name, msg, frames, header, scalars, arrays))
        self.with_arrays = [b for b in self.bases if b.arrays]
        self.checked = [b for b in self.bases if type(b.msg).check is not Message.check]
        self.foreign = [b for b in self.bases if accept is not None and type(b.msg) not in accept]
        self._oversized = _pack({"type": "run.done", "schema": SCHEMA_VERSION, "pad": "x" * MAX_HEADER_BYTES})
        # (name, weight, builder): builder(rng) -> frames, may return something valid (then retried)
        self.table: list[tuple[str, float, Callable[[random.Random], Frames]]] = [
            (name, weight, getattr(self, "_" + name))
            for name, weight in MUTATIONS.items()
            if name != "foreign_type" or self.foreign
        ]
        self._names = [n for n, _, _ in self.table]
        self._weights = [w for _, w, _ in self.table]
        self._builders = [b for _, _, b in self.table]

    def __iter__(self) -> Iterator[Frames]:
        while True:
            yield self.next()

    def take(self, n: int) -> list[Frames]:
        """The next ``n`` hostile messages."""
        return [self.next() for _ in range(n)]

    def next(self) -> Frames:
        """The next hostile message (an invalid candidate is generated, checked and kept)."""
        rng = self.rng
        while True:
            i = rng.choices(range(len(self._builders)), self._weights)[0]
            frames = self._builders[i](rng)
            reason = classify(frames, self.accept)
            if reason is not None:
                self.reasons[reason] += 1
                self.mutations[self._names[i]] += 1
                return frames

    # -- helpers ---------------------------------------------------------------------------------

    def _base(self, rng: random.Random, pool: list[_Base] | None = None) -> _Base:
        return rng.choice(pool or self.bases)

    def _with_header(self, base: _Base, header: Any) -> Frames:
        return [_pack(header), *base.frames[1:]]

    def _edit(self, rng: random.Random, base: _Base, header: dict[str, Any]) -> dict[str, Any]:
        """One random semantic edit of a (copied) header."""
        edit = rng.choice(_HEADER_EDITS)
        return edit(self, rng, base, header)

    # -- frame-level mutations --------------------------------------------------------------------

    def _random_bytes(self, rng: random.Random) -> Frames:
        return [rng.randbytes(rng.choice((0, 1, 2, 3, 7, 64, 300, 4096))) for _ in range(rng.randint(1, 4))]

    def _random_msgpack(self, rng: random.Random) -> Frames:
        """Well-formed msgpack of random shape (rarely a map with a string ``type``)."""
        value = rng.choice(_junk_values(rng) + [{"type": rng.choice(list(MESSAGE_TYPES))}, {"schema": 1}])
        return [_pack(value), *[rng.randbytes(rng.randint(0, 32)) for _ in range(rng.randint(0, 2))]]

    def _truncated_header(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        head = base.frames[0]
        return [head[: rng.randrange(len(head))], *base.frames[1:]]

    def _header_trailing_bytes(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        return [base.frames[0] + rng.randbytes(rng.randint(1, 8)), *base.frames[1:]]

    def _header_bitflip(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        head = bytearray(base.frames[0])
        for _ in range(rng.randint(1, 4)):
            head[rng.randrange(len(head))] ^= 1 << rng.randrange(8)
        return [bytes(head), *base.frames[1:]]

    def _oversized_header(self, rng: random.Random) -> Frames:
        return [self._oversized]

    def _drop_frames(self, rng: random.Random) -> Frames:
        base = self._base(rng, self.with_arrays)
        frames = list(base.frames)
        k = rng.randint(1, len(frames) - 1)
        for _ in range(k):
            frames.pop(rng.randrange(1, len(frames)))
        return frames

    def _extra_frames(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        frames = list(base.frames)
        for _ in range(rng.randint(1, 3)):
            extra = rng.choice([b"", rng.randbytes(rng.randint(1, 64)), rng.choice(frames)])
            frames.insert(rng.randint(1, len(frames)), extra)
        return frames

    def _swap_frames(self, rng: random.Random) -> Frames:
        base = self._base(rng, [b for b in self.with_arrays if len(b.arrays) >= 2])  # two frames to swap
        frames = list(base.frames)
        i, j = rng.sample(range(1, len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]
        return frames

    def _resize_array_frame(self, rng: random.Random) -> Frames:
        base = self._base(rng, self.with_arrays)
        frames = list(base.frames)
        i = rng.randrange(1, len(frames))
        f = frames[i]
        if f and rng.random() < 0.5:
            frames[i] = f[: rng.randrange(len(f))]
        else:
            frames[i] = f + rng.randbytes(rng.choice((1, 3, 4, 8, 64)))
        return frames

    def _random_array_frame(self, rng: random.Random) -> Frames:
        """An array frame replaced by random bytes of the same length (only invalid ones are kept:
        nonsense lengths, negative versions, NaN rewards, ...)."""
        base = self._base(rng, [b for b in self.checked if b.arrays])
        frames = list(base.frames)
        i = rng.randrange(1, len(frames))
        frames[i] = rng.randbytes(len(frames[i]))
        return frames

    # -- raw header bytes -------------------------------------------------------------------------

    def _items(self, base: _Base) -> list[tuple[bytes, bytes]]:
        return [(_pack(k), _pack(v)) for k, v in base.header.items()]

    def _splice(self, rng: random.Random, value: bytes, base: _Base | None = None) -> Frames:
        """The base header with one value (or a new key's value) replaced by raw bytes."""
        base = base or self._base(rng)
        items = self._items(base)
        if rng.random() < 0.3:
            items.append((_pack("zz_extra"), value))
        else:
            i = rng.randrange(len(items))
            items[i] = (items[i][0], value)
        return [_raw_map(items), *base.frames[1:]]

    def _huge_length_prefix(self, rng: random.Random) -> Frames:
        if rng.random() < 0.2:
            return [_huge_prefix(rng)]
        return self._splice(rng, _huge_prefix(rng))

    def _deep_nesting(self, rng: random.Random) -> Frames:
        depth = rng.choice((200, 1000, 1100, 5000, 100_000))
        opener = rng.choice((b"\x91", b"\x81\xa1k"))  # [x] or {"k": x}
        raw = opener * depth + b"\xc0"
        roll = rng.random()
        if roll < 0.2:
            return [raw]
        if roll < 0.5 and self.with_arrays:  # inside an array descriptor: name, dtype or shape
            base = self._base(rng, self.with_arrays)
            descs = [_pack(d) for d in base.header["arrays"]]
            i = rng.randrange(len(descs))
            d = base.header["arrays"][i]
            items = [(_pack(k), raw if k == rng.choice(list(d)) else _pack(v)) for k, v in d.items()]
            descs[i] = _raw_map(items)
            arrays = bytes([0x90 | len(descs)]) if len(descs) < 16 else b"\xdc" + struct.pack(">H", len(descs))
            items = [
                (_pack(k), arrays + b"".join(descs) if k == "arrays" else _pack(v)) for k, v in base.header.items()
            ]
            return [_raw_map(items), *base.frames[1:]]
        return self._splice(rng, raw)

    def _ext_type(self, rng: random.Random) -> Frames:
        """A msgpack ext value (any code, zero-length ones included), bare or nested."""
        code = struct.pack("b", rng.randint(-128, 127))
        data = rng.choice((b"", b"", rng.randbytes(rng.choice((1, 2, 4, 8, 12, 16, 3)))))
        fixext = {1: b"\xd4", 2: b"\xd5", 4: b"\xd6", 8: b"\xd7", 16: b"\xd8"}
        if len(data) in fixext and rng.random() < 0.5:
            ext = fixext[len(data)] + code + data
        else:
            ext = b"\xc7" + bytes([len(data)]) + code + data
        raw = rng.choice([ext, b"\x91" + ext, b"\x81\xa1k" + ext, b"\x82\xa6target\xa1x\xa1e\x92\x01" + ext])
        return self._splice(rng, raw)

    def _non_string_keys(self, rng: random.Random) -> Frames:
        key = rng.choice([_pack(1), _pack(-7), _pack(None), _pack(1.5), _pack(True), b"\x91\x01", b"\x80"])
        base = self._base(rng)
        items = self._items(base)
        if rng.random() < 0.5:
            items.insert(rng.randint(0, len(items)), (key, _pack("x")))
            return [_raw_map(items), *base.frames[1:]]
        return self._splice(rng, _map_prefix(1) + key + _pack(0), base)

    def _invalid_utf8(self, rng: random.Random) -> Frames:
        bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"abc\x80"])
        raw = bytes([0xA0 | len(bad)]) + bad
        base = self._base(rng)
        items = self._items(base)
        if rng.random() < 0.3:  # as a key
            items.insert(0, (raw, _pack(1)))
            return [_raw_map(items), *base.frames[1:]]
        return self._splice(rng, raw, base)

    def _non_map_header(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        value = rng.choice(
            [
                list(base.header.values()),
                list(base.header.items()),
                [base.type_name, SCHEMA_VERSION],
                base.type_name,
                None,
                0,
                1,
                3.5,
                True,
                b"\x00" * 8,
                [],
                [base.header],
            ]
        )
        return [_pack(value), *base.frames[1:]]

    # -- semantic header edits (through msgpack) --------------------------------------------------

    def _header_edit(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        return self._with_header(base, self._edit(rng, base, dict(base.header)))

    def _stacked_edits(self, rng: random.Random) -> Frames:
        base = self._base(rng)
        header = dict(base.header)
        for _ in range(rng.randint(2, 4)):
            header = self._edit(rng, base, header)
        frames = self._with_header(base, header)
        if rng.random() < 0.3 and len(frames) > 1:
            frames.pop(rng.randrange(1, len(frames)))
        return frames

    def _retype(self, rng: random.Random) -> Frames:
        """The header of one type, its ``type`` set to another registered type."""
        base = self._base(rng)
        header = dict(base.header)
        header["type"] = rng.choice([t for t in MESSAGE_TYPES if t != base.type_name])
        return self._with_header(base, header)

    def _too_many_arrays(self, rng: random.Random) -> Frames:
        base = self._base(rng, self.with_arrays)
        header = dict(base.header)
        n = rng.choice((MAX_ARRAYS + 1, 1000, 20_000))
        header["arrays"] = [{"name": base.arrays[0], "dtype": "uint8", "shape": [0]}] * n
        return [_pack(header), *([b""] * min(n, 200))]

    # -- cross-field inconsistencies --------------------------------------------------------------

    def _inconsistent(self, rng: random.Random) -> Frames:
        base = self._base(rng, self.checked)
        msg = base.msg
        if isinstance(msg, MicroBatch):
            changes = _inconsistent_micro_batch(rng, msg)
        elif isinstance(msg, Prompt):
            changes = rng.choice(
                [{"temperature": rng.choice([0.0, -1.0])}, {"eval_round": 3, "eval_size": 0}, {"eval_size": 5}]
            )
        elif isinstance(msg, WeightGroup):
            changes = rng.choice(
                [
                    {"generation": -1},
                    {"port": rng.choice([0, 70_000])},
                    {"filesystem": [msg.members[0]]},
                    {"members": [msg.members[0]] * 2},
                ]
            )
        elif isinstance(msg, WeightGroupAck):
            changes = {"generation": rng.randint(-5, -1)}
        elif isinstance(msg, WeightsRequest):
            changes = rng.choice([{"version": -1}, {"buckets": [-1]}, {"buckets": list(range(65))}])
        elif isinstance(msg, ApiCall):
            changes = rng.choice([{"datum_lens": np.array([5, 8], dtype=np.int64)}, {"loss_inputs": np.zeros((3, 11))}])
        elif isinstance(msg, ApiReply):
            changes = rng.choice([{"category": ""}, {"ok": True}, {"category": "bogus"}])
        elif isinstance(msg, WeightsBucket):
            changes = rng.choice(
                [
                    {"index": msg.num_buckets},
                    {"index": -1},
                    {"crc32": -1},
                    {"crc32": 2**32},
                    {"bucket_bytes": 0},
                    {"version": -2},
                ]
            )
        elif isinstance(msg, ComponentHeartbeat):  # a failure record malformed or of the wrong field types
            changes = rng.choice(
                [
                    {"failures": {"reward/f": "TypeError"}},
                    {"failures": {"reward/f": {"kind": "reward", "calls": 64}}},
                    {"failures": {"reward/f": {**_FAILURE_RECORD, "errors": "3"}}},
                    {"failures": {"reward/f": {**_FAILURE_RECORD, "calls": True}}},
                ]
            )
        else:
            changes = _inconsistent_group(rng, msg)
        return [bytes(memoryview(f)) for f in encode(dataclasses.replace(msg, **changes))]

    def _foreign_type(self, rng: random.Random) -> Frames:
        """A valid message of a type this receiver does not accept."""
        base = self._base(rng, self.foreign)
        header = dict(base.header)
        header["id"] = "%032x" % rng.getrandbits(128)
        return self._with_header(base, header)


# -- header edits ----------------------------------------------------------------------------------


def _edit_schema(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    if rng.random() < 0.15:
        h.pop("schema", None)
    else:
        h["schema"] = rng.choice(
            [0, 2, -1, SCHEMA_VERSION + 1, 2**32, 2**64 - 1, "1", b"\x01", 1.0, True, None, [1], {"v": 1}, math.nan]
        )
    return h


def _edit_type(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    if rng.random() < 0.15:
        h.pop("type", None)
    else:
        t = base.type_name
        h["type"] = rng.choice(
            [
                t + ".v2",
                t.upper(),
                t + " ",
                "\x00" + t,
                "",
                "x" * rng.randint(1, 300),
                t.encode(),
                [t],
                {"t": t},
                3,
                None,
                True,
                "rollout.v2",
                "weights.evil",
                "__import__('os')",
            ]
        )
    return h


def _edit_missing_field(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    h.pop(rng.choice(base.scalars), None)
    return h


def _edit_field_type(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    h[rng.choice(base.scalars)] = rng.choice(_junk_values(rng))
    return h


def _edit_bool_for_int(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    ints = [k for k in base.scalars if k in _INT_FIELDS] or list(base.scalars)
    h[rng.choice(ints)] = rng.choice([True, False])
    return h


def _edit_list_elements(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    """A list / dict field with one element of the wrong type (or the container's type changed)."""
    lists = [k for k in base.scalars if isinstance(base.header[k], (list, dict))]
    if not lists:
        return _edit_field_type(g, rng, base, h)
    key = rng.choice(lists)
    value = base.header[key]
    junk = rng.choice([1, None, 2.5, True, b"b", ["nested"], {"k": "v"}, _deep(rng.randint(2, 40))])
    if isinstance(value, list):
        new = list(value)
        new.insert(rng.randint(0, len(new)), junk)
        h[key] = rng.choice([new, tuple(new), {str(i): v for i, v in enumerate(value)}, "".join(map(str, value))])
    else:
        new = dict(value)
        new[rng.choice(list(new) or ["k"])] = junk
        h[key] = rng.choice([new, list(value.items()), list(value), None])
    return h


def _edit_arrays(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    """The ``arrays`` list itself: junk, missing, reordered, shortened or padded."""
    arrays = list(base.header["arrays"])
    choice = rng.randrange(6)
    if choice == 0:
        h.pop("arrays", None)
    elif choice == 1:
        h["arrays"] = rng.choice([None, 0, "arrays", {}, {"name": "x"}, [1, 2], [[]], [None], b"\x00", True])
    elif choice == 2 and len(arrays) > 1:
        h["arrays"] = arrays[1:] if rng.random() < 0.5 else arrays[:-1]
    elif choice == 3:
        h["arrays"] = [*arrays, rng.choice(arrays or [{"name": "x", "dtype": "int32", "shape": [0]}])]
    elif choice == 4 and len(arrays) > 1:
        shuffled = list(arrays)
        while shuffled == arrays:
            rng.shuffle(shuffled)
        h["arrays"] = shuffled
    else:
        h["arrays"] = [[d["name"], d["dtype"], d["shape"]] for d in arrays] or [["x", "int32", [0]]]
    return h


def _edit_descriptor(g: HostileMessages, rng: random.Random, base: _Base, h: dict[str, Any]) -> dict[str, Any]:
    """One array descriptor: name, dtype, shape or keys broken."""
    arrays = [dict(d) for d in base.header["arrays"]]
    if not arrays:
        h["arrays"] = [{"name": rng.choice(["x", "rewards", "id"]), "dtype": "int32", "shape": [0]}]
        return h
    d = rng.choice(arrays)
    what = rng.randrange(6)
    if what == 0:  # name
        d["name"] = rng.choice(
            [
                "bogus",
                "",
                d["name"].upper(),
                d["name"] + "\x00",
                3,
                None,
                [d["name"]],
                b"x",
                rng.choice([a["name"] for a in arrays]),
                "rewards",
                "input_ids",
                "step",
                "__class__",
            ]
        )
    elif what == 1:  # dtype
        d["dtype"] = rng.choice(_BAD_DTYPES + [x for x in _ALLOWED if x != d["dtype"]])
    elif what == 2:  # shape
        n = d["shape"][0] if d["shape"] else 0
        d["shape"] = rng.choice(
            [
                [2**40],
                [2**62],
                [2**63 - 1],
                [2**64 - 1],
                [-1],
                [-n],
                [-(2**63)],
                [n + 1],
                [max(n - 1, 0) + 2],
                [n, 1],
                [1, n],
                [],
                [1, 1, 1, 1, 1],
                [2**32, 2**32],
                [n * 2**32],
                [float(n)],
                [True],
                [[n]],
                [str(n)],
                [None],
                str(n),
                n,
                None,
                {"0": n},
                (n,),
            ]
        )
    elif what == 3:  # dtype and shape that agree with the frame size but not with the type
        itemsize = {"bool": 1, "uint8": 1, "int32": 4, "int64": 8, "float32": 4, "float64": 8}
        nbytes = (d["shape"][0] if d["shape"] else 0) * itemsize[d["dtype"]]
        options = [x for x in _ALLOWED if x != d["dtype"] and nbytes % itemsize[x] == 0]
        if options:
            d["dtype"] = rng.choice(options)
            d["shape"] = [nbytes // itemsize[d["dtype"]]]
        else:
            d["shape"] = [nbytes, 1]
    elif what == 4:  # keys
        if rng.random() < 0.5:
            d.pop(rng.choice(["name", "dtype", "shape"]))
        else:
            d[rng.choice(["stride", "offset", "order", "byteorder"])] = rng.choice([0, "F", [4]])
    else:  # the descriptor is not a map
        arrays[arrays.index(d)] = rng.choice([[d["name"], d["dtype"], d["shape"]], d["name"], None, 0, []])
    h["arrays"] = arrays
    return h


_FAILURE_RECORD = {
    "kind": "reward",
    "calls": 64,
    "errors": 3,
    "share": 0.05,
    "window": 64,
    "error": "TypeError",
    "message": "m",
    "level": "ok",
}
"""A well-formed ``component.heartbeat`` failure record (bus.messages._FAILURE_FIELDS)."""

_HEADER_EDITS = [
    _edit_schema,
    _edit_type,
    _edit_missing_field,
    _edit_field_type,
    _edit_bool_for_int,
    _edit_list_elements,
    _edit_arrays,
    _edit_descriptor,
    _edit_descriptor,
]


# -- cross-field inconsistencies -------------------------------------------------------------------


def _inconsistent_group(rng: random.Random, msg: RolloutGroup) -> dict[str, Any]:
    g, n = len(msg.completion_lens), len(msg.completion_ids)
    what = rng.randrange(9)
    if what == 8:  # version spans: not covering the tokens, negative, empty, min/max off start/end, counts off
        spans, counts = np.array(msg.version_spans), np.array(msg.version_span_counts)
        k = rng.randrange(len(spans))
        return rng.choice(
            [
                {"version_spans": np.concatenate([spans, [[3, 1]]]).astype(np.int64)},
                {"version_spans": np.where(np.arange(len(spans))[:, None] == k, [[-1, 0]], 0) + spans},
                {"version_spans": np.where(np.arange(len(spans))[:, None] == k, [[0, 1]], 0) + spans},
                {"version_spans": np.where(np.arange(len(spans))[:, None] == k, [[1, 0]], 0) + spans},
                {"version_spans": np.where(np.arange(len(spans))[:, None] == k, [[0, -spans[k, 1]]], 0) + spans},
                {"version_span_counts": counts[:-1]},
                {"version_span_counts": np.zeros(0, np.int32)},
                {"version_spans": spans[:, :1].copy()},
            ]
        )
    if what == 0:  # lens that do not add up, or negative ones
        lens = np.array([rng.randint(-3, 20) for _ in range(g)], np.int32)
        return {"completion_lens": lens}
    if what == 1:  # logprobs of the wrong length
        return {"sampler_logprobs": np.zeros(rng.choice([0, n - 1, n + 1, 2 * n]), np.float32)}
    if what == 2:  # per-completion lists of the wrong length
        k = rng.choice([0, g - 1, g + 1, 3 * g])
        key = rng.choice(["completion_texts", "finish_reasons"])
        return {key: ["stop"] * k}
    if what == 3:  # versions: wrong length, negative, end before start
        k = rng.choice([g - 1, g + 1])
        return rng.choice(
            [
                {"version_start": np.zeros(k, np.int64)},
                {"version_end": np.zeros(k, np.int64) + 5},
                {"version_start": np.array([-1] * g, np.int64), "version_end": np.array([-1] * g, np.int64)},
                {"version_start": msg.version_end + 1},
            ]
        )
    if what == 4:  # an empty group
        empty = dict(
            completion_ids=np.zeros(0, np.int32),
            completion_lens=np.zeros(0, np.int32),
            sampler_logprobs=np.zeros(0, np.float32),
            version_start=np.zeros(0, np.int64),
            version_end=np.zeros(0, np.int64),
            completion_texts=[],
            finish_reasons=[],
        )
        if isinstance(msg, ScoredGroup):
            empty.update(rewards=np.zeros(0, np.float32), advantages=np.zeros(0, np.float32))
        return empty
    if isinstance(msg, ScoredGroup):
        if what in (5, 6):  # rewards / advantages of the wrong length
            key = rng.choice(["rewards", "advantages"])
            return {key: np.zeros(rng.choice([0, g - 1, g + 1]), np.float32)}
        bad = np.array(msg.rewards, np.float32)  # non-finite
        bad[rng.randrange(g)] = rng.choice([np.nan, np.inf, -np.inf])
        return {rng.choice(["rewards", "advantages"]): bad}
    return {"completion_lens": msg.completion_lens + 1}


def _inconsistent_micro_batch(rng: random.Random, msg: MicroBatch) -> dict[str, Any]:
    t, s = len(msg.input_ids), len(msg.seq_lens)
    what = rng.randrange(7)
    if what == 6:  # token versions: wrong length, negative, a sample's minimum not its oldest version
        bad = np.array(msg.token_versions)
        bad[rng.randrange(t)] = rng.choice([-1, int(msg.oldest_versions.min()) - 1])
        return rng.choice(
            [
                {"token_versions": np.zeros(rng.choice([0, t - 1, t + 1]), np.int64)},
                {"token_versions": bad},
                {"token_versions": np.array(msg.token_versions) + 1},
            ]
        )
    if what == 0:
        return rng.choice(
            [
                {"micro_index": msg.num_micro_batches},
                {"micro_index": -1},
                {"step": -1},
                {"num_micro_batches": 0},
                {"micro_index": 2**62},
            ]
        )
    if what == 1:  # seq_lens not adding up, zero or negative
        lens = np.array(msg.seq_lens)
        lens[rng.randrange(s)] = rng.choice([0, -5, lens[0] + 1])
        return {"seq_lens": lens.astype(np.int32)}
    if what == 2:  # per-token arrays of the wrong length
        key = rng.choice(["loss_mask", "sampler_logprobs", "advantages"])
        dtype = np.bool_ if key == "loss_mask" else np.float32
        return {key: np.zeros(rng.choice([0, t - 1, t + 1]), dtype)}
    if what == 3:
        return {"rewards": np.zeros(rng.choice([0, s - 1, s + 1]), np.float32)}
    if what == 4:
        return {"oldest_versions": np.zeros(rng.choice([0, s + 1]), np.int64)}
    return {"sample_ids": msg.sample_ids[: rng.randrange(s)] if rng.random() < 0.5 else [*msg.sample_ids, "x/0"]}


MUTATIONS: dict[str, float] = {
    "random_bytes": 6,
    "random_msgpack": 3,
    "truncated_header": 6,
    "header_trailing_bytes": 2,
    "header_bitflip": 5,
    "oversized_header": 0.02,
    "drop_frames": 4,
    "extra_frames": 4,
    "swap_frames": 2,
    "resize_array_frame": 4,
    "random_array_frame": 3,
    "huge_length_prefix": 5,
    "deep_nesting": 2,
    "ext_type": 3,
    "non_string_keys": 2,
    "invalid_utf8": 2,
    "non_map_header": 2,
    "header_edit": 25,
    "stacked_edits": 6,
    "retype": 3,
    "too_many_arrays": 0.5,
    "inconsistent": 8,
    "foreign_type": 5,
}
"""Every mutation and its relative frequency (``foreign_type`` only when ``accept`` is given)."""


# -- the delivery layer (bus.envelope, bus.inbox, bus.outbox) -------------------------------------


def classify_delivery(
    frames: Frames, role: str, accept: tuple[type[Message], ...], held: frozenset[str] = frozenset()
) -> str | None:
    """The reject reason a box (:mod:`bus.inbox`, :mod:`bus.outbox`) gives the frame set ``frames`` (as received,
    without a routing id), or None if it takes it.

    The envelope is judged by the box's own parser (as :func:`classify` uses ``decode``; the
    named cases in ``tests/bus/test_reliable.py`` pin the parser down), the rest by the protocol:

    Args:
        role: ``"inbox"`` (takes ``D`` and ``H``) or ``"outbox"`` (takes ``A`` and ``B``).
        accept: the inbox's ``accept`` tuple.
        held: ids the outbox holds at a *real* receiver: an ack releasing any of them from the
            fuzzing peer is refused (``foreign_ack``).
    """
    if not frames:
        return "frames"
    try:
        kind, _session, payload = parse_envelope(frames[0])
    except WireError as exc:
        return exc.reason
    if role == "inbox":
        if kind in ("A", "B"):
            return "wrong_direction"
        if kind == "H":
            return None
        reason = classify(frames[1:], accept)
        if reason is not None:
            return reason
        return "id_mismatch" if decode(frames[1:]).id != payload else None
    if kind in ("D", "H"):
        return "wrong_direction"
    if kind == "A" and any(i in held for i in payload[2]):
        return "foreign_ack"
    return None


def envelope(kind: Any, session: Any, payload: Any, protocol: Any = 1) -> bytes:
    """A delivery envelope ``[protocol, kind, session, payload]`` in msgpack, built independently
    of :mod:`bus.envelope` (what the wire table in its docstring says)."""
    return _pack([protocol, kind, session, payload])


class HostileEnvelopes:
    """An endless, seeded stream of delivery-protocol frame sets that a box must reject.

    For an inbox (``role="inbox"``) about half are well-formed ``D`` envelopes carrying a message
    of :class:`HostileMessages`, the rest broken envelopes: random bytes, truncated, bit-flipped,
    over-long or oversized frames, wrong protocol / kind / session, bad payloads of every kind
    (negative, huge, bool or float credit, non-string or too many ids, ext / bin / map values,
    deep nesting, huge length prefixes), envelopes of the other direction, a valid message under
    another id, a ``D`` without a message. For an outbox (``role="outbox"``), the same broken
    envelopes and wrong directions, plus forged acks: a well-formed ``A`` (no credit) releasing
    ids in ``held`` (messages a real receiver holds). Every candidate is checked with
    :func:`classify_delivery` and kept only if it must be rejected.

    Args:
        seed: seeds a private ``random.Random``. role: ``"inbox"`` or ``"outbox"``.
        accept: the inbox's ``accept`` tuple (also picks the messages of valid ``D`` envelopes).
        held: see :func:`classify_delivery`.
        session: the session string of envelopes that are not broken there.

    Attributes:
        reasons / mutations: ``Counter`` of the expected reject reason / the mutation of every
        yielded frame set.
    """

    def __init__(
        self, seed: int, role: str, accept: tuple[type[Message], ...], held: list[str] = (), session: str = "fuzzer"
    ) -> None:
        if role not in ("inbox", "outbox"):
            raise ValueError(f"role must be 'inbox' or 'outbox', got {role!r}")
        self.rng = random.Random(seed)
        self.role, self.accept, self.session = role, accept, session
        self.held = frozenset(held)
        self.held_list = list(held)
        self.messages = HostileMessages(seed + 1, accept)
        examples = realistic_examples()
        self.valid = [bytes(memoryview(f)) for f in encode(examples[accept[0].TYPE])]
        self.valid_id = examples[accept[0].TYPE].id
        self.reasons: Counter[str] = Counter()
        self.mutations: Counter[str] = Counter()
        table = ENVELOPE_MUTATIONS | (INBOX_MUTATIONS if role == "inbox" else OUTBOX_MUTATIONS)
        if not self.held:
            table = {k: v for k, v in table.items() if k != "forged_ack"}
        self._names = list(table)
        self._weights = list(table.values())

    def next(self) -> Frames:
        """The next hostile frame set."""
        rng = self.rng
        while True:
            name = rng.choices(self._names, self._weights)[0]
            frames = getattr(self, "_" + name)(rng)
            reason = classify_delivery(frames, self.role, self.accept, self.held)
            if reason is not None:
                self.reasons[reason] += 1
                self.mutations[name] += 1
                return frames

    def take(self, n: int) -> list[Frames]:
        """The next ``n`` hostile frame sets."""
        return [self.next() for _ in range(n)]

    # -- well-formed material ----------------------------------------------------------------------

    def _id(self, rng: random.Random) -> str:
        return "%032x" % rng.getrandbits(128)

    def _good(self, rng: random.Random, kind: str | None = None) -> Frames:
        """A well-formed frame set of ``kind`` (random kind if None)."""
        kind = kind or rng.choice("DAHB")
        if kind == "D":
            msg_id = self._id(rng)
            return [envelope("D", self.session, msg_id), *self.valid]
        if kind == "A":
            ids = [self._id(rng) for _ in range(rng.randint(0, 3))]
            return [envelope("A", self.session, [rng.randint(0, 8), ids, list(ids)])]
        return [envelope(kind, self.session, None)]

    def _junk(self, rng: random.Random) -> Any:
        return rng.choice(_junk_values(rng) + [b"", {"k": 1}, msgpack.ExtType(3, b""), "x" * (MAX_ID_CHARS + 1)])

    # -- mutations of any box ------------------------------------------------------------------------

    def _random_bytes(self, rng: random.Random) -> Frames:
        return [rng.randbytes(rng.choice((0, 1, 2, 3, 7, 64, 300, 4096))) for _ in range(rng.randint(1, 3))]

    def _random_msgpack(self, rng: random.Random) -> Frames:
        return [_pack(self._junk(rng)), *[rng.randbytes(rng.randint(0, 16)) for _ in range(rng.randint(0, 2))]]

    def _truncated(self, rng: random.Random) -> Frames:
        frames = self._good(rng)
        return [frames[0][: rng.randrange(len(frames[0]))], *frames[1:]]

    def _trailing_bytes(self, rng: random.Random) -> Frames:
        frames = self._good(rng)
        return [frames[0] + rng.randbytes(rng.randint(1, 8)), *frames[1:]]

    def _bitflip(self, rng: random.Random) -> Frames:
        frames = self._good(rng)
        head = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            head[rng.randrange(len(head))] ^= 1 << rng.randrange(8)
        return [bytes(head), *frames[1:]]

    def _oversized(self, rng: random.Random) -> Frames:
        return [envelope("H", self.session, "x" * MAX_ENVELOPE_BYTES)]

    def _field_edit(self, rng: random.Random) -> Frames:
        """One of protocol, kind or session replaced (or the list's length changed)."""
        frames = self._good(rng)
        env = msgpack.unpackb(frames[0], raw=False)
        what = rng.randrange(4)
        if what == 0:
            env[0] = rng.choice([0, 2, -1, 2**64 - 1, "1", None, [1], 1.5, self._junk(rng)])
        elif what == 1:
            env[1] = rng.choice(["X", "", "d", "DA", "A ", "\x00", 1, None, b"D", ["D"], self._junk(rng)])
        elif what == 2:
            env[2] = rng.choice(["", 1, None, [], b"s", "s" * (MAX_ID_CHARS + 1), self._junk(rng)])
        else:
            env = env[: rng.randrange(4)] if rng.random() < 0.5 else [*env, self._junk(rng)]
        return [_pack(env), *frames[1:]]

    def _payload_edit(self, rng: random.Random) -> Frames:
        """A kind with a payload it cannot have."""
        if rng.random() < 0.4:  # data: the message id
            bad_id = rng.choice([None, "", 7, ["id"], b"id", "i" * (MAX_ID_CHARS + 1), self._junk(rng)])
            return [envelope("D", self.session, bad_id), *self.valid]
        ids = [self._id(rng)]
        payload = rng.choice(
            [
                [-1, [], []],
                [1_000_001, [], []],
                [2**63, [], []],
                [True, [], []],
                [1.5, [], []],
                ["1", [], []],
                [None, [], []],
                [1, []],
                [1, [], [], []],
                [],
                None,
                "ack",
                [1, ids, "x"],
                [1, "x", ids],
                [1, [3], []],
                [1, [], [None]],
                [1, [ids], []],
                [1, [b"id"], []],
                {"free": 1},
                [0, ["i"] * (MAX_IDS_PER_ACK + 1), []],
                [0, [], ["i" * (MAX_ID_CHARS + 1)]],
                [self._junk(rng), ids, ids],
            ]
        )
        return [envelope("A", self.session, payload)]

    def _huge_length_prefix(self, rng: random.Random) -> Frames:
        head = b"\x94\x01" + rng.choice([b"\xa1D", b"\xa1A"]) + rng.choice([b"", _pack(self.session)])
        return [head + _huge_prefix(rng)]

    def _deep_nesting(self, rng: random.Random) -> Frames:
        depth = rng.choice((100, 1000, 1100, 5000))
        opener = rng.choice((b"\x91", b"\x81\xa1k"))
        return [b"\x94\x01\xa1A" + _pack(self.session) + opener * depth + b"\xc0"]

    def _wrong_direction(self, rng: random.Random) -> Frames:
        return self._good(rng, rng.choice("AB" if self.role == "inbox" else "DH"))

    # -- inbox only ----------------------------------------------------------------------------------

    def _message(self, rng: random.Random) -> Frames:
        """A well-formed data envelope around a hostile message."""
        return [envelope("D", self.session, self._id(rng)), *self.messages.next()]

    def _id_mismatch(self, rng: random.Random) -> Frames:
        return [envelope("D", self.session, self._id(rng)), *self.valid]

    def _no_message(self, rng: random.Random) -> Frames:
        return [envelope("D", self.session, self._id(rng))]

    # -- outbox only ---------------------------------------------------------------------------------

    def _forged_ack(self, rng: random.Random) -> Frames:
        """A well-formed ack without credit that releases messages a real receiver holds."""
        done = rng.sample(self.held_list, rng.randint(1, len(self.held_list))) + [self._id(rng)] * rng.randint(0, 2)
        rng.shuffle(done)
        session = rng.choice([self.session, self._id(rng)[:16]])
        return [envelope("A", session, [0, rng.sample(done, rng.randint(0, len(done))), done])]


ENVELOPE_MUTATIONS: dict[str, float] = {
    "random_bytes": 6,
    "random_msgpack": 4,
    "truncated": 5,
    "trailing_bytes": 2,
    "bitflip": 6,
    "oversized": 0.05,
    "field_edit": 14,
    "payload_edit": 10,
    "huge_length_prefix": 4,
    "deep_nesting": 1,
    "wrong_direction": 5,
}
"""Mutations of any box's frame sets and their relative frequency."""

INBOX_MUTATIONS: dict[str, float] = {"message": 50, "id_mismatch": 2, "no_message": 1}
OUTBOX_MUTATIONS: dict[str, float] = {"forged_ack": 8}
