"""Self-describing blob for one request's compressed KV.

Layout (little-endian)::

    0   4  magic  b"KVTX"
    4   1  version (1)
    5   1  flags (0, reserved)
    6   4  header length h
    10  h  header: UTF-8 JSON {"spec": str, "entries": [{"key", "shape", "dtype", "meta",
                               "streams": [{"name", "dtype", "shape", "bits", "bf16", "n"}]}]}
    ..     payload: every stream's coded bytes, in header order (n bytes each)
    -4  4  CRC-32 of everything before it

Anything that does not parse, or whose checksum or lengths disagree, raises ContainerError.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ContainerError

MAGIC = b"KVTX"
VERSION = 1
_HEAD = struct.Struct("<4sBBI")


@dataclass
class StreamRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bits: int | None
    bf16: bool
    payload: bytes


@dataclass
class Entry:
    key: str | None
    shape: tuple[int, ...]
    dtype: str
    meta: dict[str, Any] = field(default_factory=dict)
    streams: list[StreamRecord] = field(default_factory=list)


def pack(spec: str, entries: list[Entry]) -> bytes:
    header = {
        "spec": spec,
        "entries": [
            {"key": e.key, "shape": list(e.shape), "dtype": e.dtype, "meta": e.meta,
             "streams": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "bits": s.bits,
                          "bf16": s.bf16, "n": len(s.payload)} for s in e.streams]}
            for e in entries
        ],
    }
    hb = json.dumps(header, separators=(",", ":")).encode()
    parts = [_HEAD.pack(MAGIC, VERSION, 0, len(hb)), hb]
    parts += [s.payload for e in entries for s in e.streams]
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def unpack(blob: bytes | bytearray | memoryview) -> tuple[str, list[Entry]]:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ContainerError(f"blob must be bytes, got {type(blob).__name__}")
    b = memoryview(blob)
    if len(b) < _HEAD.size + 4:
        raise ContainerError(f"blob too short ({len(b)} bytes) to be a kvtide transfer container")
    magic, version, flags, hlen = _HEAD.unpack_from(b, 0)
    if magic != MAGIC:
        raise ContainerError(f"not a kvtide transfer container (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ContainerError(f"unsupported container version {version} (this build reads {VERSION})")
    (crc,) = struct.unpack_from("<I", b, len(b) - 4)
    if zlib.crc32(b[:-4]) != crc:
        raise ContainerError("checksum mismatch: blob damaged or truncated")
    if flags != 0 or _HEAD.size + hlen > len(b) - 4:
        raise ContainerError("bad container header")
    try:
        header = json.loads(bytes(b[_HEAD.size: _HEAD.size + hlen]))
        off = _HEAD.size + hlen
        entries = []
        for e in header["entries"]:
            recs = []
            for s in e["streams"]:
                n = int(s["n"])
                if n < 0 or off + n > len(b) - 4:
                    raise ContainerError("stream runs past the end of the blob")
                np.dtype(s["dtype"])  # validates
                recs.append(StreamRecord(str(s["name"]), str(s["dtype"]), tuple(int(x) for x in s["shape"]),
                                         s["bits"], bool(s["bf16"]), bytes(b[off: off + n])))
                off += n
            entries.append(Entry(e["key"], tuple(int(x) for x in e["shape"]), str(e["dtype"]), dict(e["meta"]), recs))
        spec = str(header["spec"])
    except ContainerError:
        raise
    except (KeyError, TypeError, ValueError) as ex:
        raise ContainerError(f"malformed container header: {ex}") from ex
    if off != len(b) - 4:
        raise ContainerError(f"{len(b) - 4 - off} unaccounted payload bytes")
    return spec, entries
