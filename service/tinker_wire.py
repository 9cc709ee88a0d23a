"""The Tinker SDK's wire format (0.25+): forward_backward requests arrive as its ``tinker_public`` protobuf
(optionally zstd), ForwardBackwardOutput and SampleResponse results leave as protobuf; the rest is JSON. Only
the SDK's own generated modules (``tinker.proto``) are used. Datums become the flat arrays of an
:class:`bus.messages_api.ApiCall`: tokens end to end, one length per datum, one row per loss input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class WireInputError(ValueError):
    """A request body the server cannot take (answered 400)."""


@dataclass
class Batch:
    """The data of a forward_backward call, flat: ``token_ids [N]``, ``datum_lens [D]``, ``loss_inputs [K, N]``
    with row names ``names``."""

    token_ids: np.ndarray
    datum_lens: np.ndarray
    names: list[str]
    loss_inputs: np.ndarray


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    batch: Batch


def flatten(datums: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> Batch:
    """``[(tokens [L], {name: [L]})]`` -> :class:`Batch`; WireInputError if a loss input is not one value per
    token or the datums name different inputs."""
    names = sorted(datums[0][1]) if datums else []
    lens, tokens, rows = [], [], {n: [] for n in names}
    for i, (toks, inputs) in enumerate(datums):
        if sorted(inputs) != names:
            raise WireInputError(f"datum {i} has loss_fn_inputs {sorted(inputs)}, datum 0 has {names}")
        for name, arr in inputs.items():
            if arr.ndim != 1 or len(arr) != len(toks):
                raise WireInputError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; "
                    f"this server takes one value per model-input token ({len(toks)})"
                )
            rows[name].append(arr.astype(np.float64))
        lens.append(len(toks))
        tokens.append(toks.astype(np.int64))
    n = int(sum(lens))
    return Batch(
        token_ids=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
        datum_lens=np.asarray(lens, dtype=np.int64),
        names=names,
        loss_inputs=np.stack([np.concatenate(rows[k]) for k in names]) if names and n else np.zeros((0, n)),
    )


def parse_forward_backward_proto(body: bytes, content_encoding: str = "") -> ForwardBackwardCall:
    """The SDK's protobuf ``ForwardBackwardRequest`` (zstd when ``content_encoding`` says so)."""
    from tinker.proto import tinker_public_pb2 as pb

    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError
        raise WireInputError(f"not a ForwardBackwardRequest protobuf: {err}") from err
    datums = []
    for i, d in enumerate(msg.data):
        chunks = []
        for c in d.model_input:
            if c.WhichOneof("chunk") != "encoded_text":
                raise WireInputError(f"datum {i}: only encoded_text model input is served (no images or audio)")
            chunks.append(np.frombuffer(c.encoded_text.tokens, dtype=np.int32))
        toks = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
        inputs = {name: _tensor(t, f"datum {i} {name}") for name, t in d.loss_fn_inputs.items()}
        datums.append((toks, inputs))
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    if not config:
        config = dict(msg.loss_fn_config)
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id or None,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        batch=flatten(datums),
    )


def _tensor(t, where: str) -> np.ndarray:
    from tinker.proto import tinker_public_pb2 as pb

    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if t.dtype not in dtypes:
        raise WireInputError(f"{where}: tensor dtype {t.dtype} is not served (float32, int64, int32)")
    if t.HasField("sparse_csr"):
        raise WireInputError(f"{where}: sparse tensors are not served")
    arr = np.frombuffer(t.dense, dtype=dtypes[t.dtype])
    if list(t.shape) and int(np.prod(t.shape)) != arr.size:
        raise WireInputError(f"{where}: {arr.size} values for shape {list(t.shape)}")
    return arr.reshape(list(t.shape)) if list(t.shape) else arr


def split_outputs(names: list[str], rows: np.ndarray, lens: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Per datum ``{name: [L] float32}`` of the reply's ``[K, N]`` output rows."""
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    return [
        {n: rows[k, starts[i] : starts[i + 1]].astype(np.float32) for k, n in enumerate(names)}
        for i in range(len(lens))
    ]


def forward_backward_output_proto(names: list[str], rows: np.ndarray, lens: np.ndarray, metrics: dict) -> bytes:
    """A ``ForwardBackwardOutput`` protobuf: one ``ArrayRecord`` whose fields hold every datum's outputs."""
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(lens)
    offsets = (np.concatenate([[0], np.cumsum(lens)]) * 4).astype(np.int64)
    for k, name in enumerate(names):
        bt = record.fields[name]
        bt.data = rows[k].astype(np.float32).tobytes()
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def tensor_json(arr: np.ndarray) -> dict:
    """A TensorData in JSON: ``{"data": [...], "dtype": "float32", "shape": [L]}``."""
    return {"data": arr.astype(np.float32).tolist(), "dtype": "float32", "shape": list(arr.shape)}
