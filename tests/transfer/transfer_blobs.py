"""Helpers for tests that take transfer containers apart and put crafted ones back together (valid checksum)."""
from __future__ import annotations

import json
import struct
from typing import Any

import torch

from kvtide.transfer.container import MAGIC, SUM_BYTES, VERSION, checksum

L, T, H, D = 2, 24, 2, 32


def kv(seed: int = 0, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, 2, t, H, D, generator=g) * 2).bfloat16()


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a container."""
    hl = struct.unpack_from("<I", blob, 6)[0]
    return json.loads(bytes(blob[10:10 + hl])), bytes(blob[10 + hl:-SUM_BYTES[blob[4]]])


def join(header: dict[str, Any] | bytes, payload: bytes) -> bytes:
    """A container with this header (a dict, or raw header bytes) and payload, and a valid checksum."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + bytes([VERSION, 0]) + struct.pack("<I", len(hb)) + hb + payload
    return body + checksum(body)


def reseal(blob: bytes | bytearray) -> bytes:
    """The same bytes with the trailing checksum recomputed (so damage reaches the parsers, not the checksum)."""
    body = bytes(blob[:-SUM_BYTES[blob[4]]])
    return body + checksum(body, blob[4])


def stream_payloads(header: dict[str, Any], payload: bytes) -> dict[str, bytes]:
    """Stream name -> coded bytes, for a single-entry container."""
    out, off = {}, 0
    for s in header["entries"][0]["streams"]:
        out[s["name"]] = payload[off: off + s["n"]]
        off += s["n"]
    return out


def replace_stream(blob: bytes, name: str, data: bytes, **fields: Any) -> bytes:
    """The container with stream ``name``'s bytes (and optionally header fields) replaced."""
    header, payload = split(blob)
    parts = stream_payloads(header, payload)
    parts[name] = data
    for s in header["entries"][0]["streams"]:
        if s["name"] == name:
            s["n"] = len(data)
            s.update(fields)
    return join(header, b"".join(parts[s["name"]] for s in header["entries"][0]["streams"]))
