"""Read a W&B ``.wandb`` run file back: the records ``wandb`` wrote, as its own protobuf messages.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
LevelDB-log-style chunks in 32 KiB blocks, each chunk ``crc32 (u32) | length (u16) | type (u8) |
data`` where type 1 is a whole record and 2/3/4 the first/middle/last part of one. The ``wandb``
package writes it (through its ``wandb-core`` service) and parses each record with
``wandb.proto.wandb_internal_pb2.Record``; this reader checks every chunk's CRC.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def raw_records(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"not a W&B run file: {path}"
    pos, out, pending = _HEADER, [], b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0 and crc == 0:  # zero padding up to the block's end
            pos += left
            continue
        body = data[pos + _HEADER : pos + _HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad chunk CRC at byte {pos} of {path}"
        pos += _HEADER + length
        if kind == 1:
            out.append(body)
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            out.append(pending + body)
            pending = b""
    return out


@dataclass
class WandbRun:
    """What one ``.wandb`` file holds, decoded."""

    run_id: str = ""
    name: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    step_metrics: dict[str, str] = field(default_factory=dict)  # metric (or glob) -> its x-axis
    exit_code: int | None = None


def read_run(path: str | Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2 as pb

    out = WandbRun()
    for raw in raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.name, out.project = rec.run.run_id, rec.run.display_name, rec.run.project
            for item in rec.run.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            out.history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out.summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "metric":
            if rec.metric.step_metric:
                out.step_metrics[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out
