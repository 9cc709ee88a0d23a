"""Read a W&B offline run back: the records of its ``run-<id>.wandb`` file, parsed with W&B's own
protobuf schema (``wandb.proto.wandb_internal_pb2.Record``).

The file is W&B's transaction log, the one ``wandb sync`` uploads: a 7-byte header (``:W&B``,
magic ``0xBEE1`` little-endian, version 0) then LevelDB-log-format blocks of 32 KiB, each
record chunk behind a 7-byte header (CRC32C 4 bytes, length 2 bytes little-endian, type 1 byte:
1 full, 2 first, 3 middle, 4 last); a block tail shorter than a chunk header is zero padding.
wandb 0.31 ships no Python reader (its Go core reads the file), hence these few lines.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of the ``.wandb`` file at ``path``, in order.

    Raises:
        ValueError: the file does not start with W&B's header, or a chunk is cut or of unknown type.
    """
    data = Path(path).read_bytes()
    if not data.startswith(FILE_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, records, parts = len(FILE_HEADER), [], []
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # zero padding at the end of the file or block
            pos += left_in_block
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        if len(chunk) != length or kind not in (1, 2, 3, 4):
            raise ValueError(f"{path}: bad chunk at byte {pos} (type {kind}, length {length})")
        pos += HEADER + length
        parts.append(chunk)
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(parts))
            records.append(rec)
            parts = []
    return records


def run_files(run_dir: Path) -> list[Path]:
    """The ``.wandb`` files of the W&B offline run(s) under ``run_dir``, oldest first (a resumed
    offline run writes a new ``offline-run-<time>-<id>`` directory with the same run id)."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


def history(run_dir: Path) -> list[dict]:
    """The logged rows (one dict per ``run.log`` call, values JSON-decoded, ``_files``: the run
    directory's ``files/`` folder that holds its media) of every offline run file under ``run_dir``;
    they must all be one W&B run (one run id)."""
    files = run_files(run_dir)
    assert files and len({f.name for f in files}) == 1, files
    rows = []
    for path in files:
        for rec in read_records(path):
            if rec.WhichOneof("record_type") == "history":
                row = {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in rec.history.item
                }
                rows.append({**row, "_files": path.parent / "files"})
    return rows


def config(run_dir: Path) -> dict:
    """The run config as recorded in the ``.wandb`` file (``{key: value}``, values JSON-decoded; the last write
    wins)."""
    out = {}
    for rec in read_records(run_files(run_dir)[0]):
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
