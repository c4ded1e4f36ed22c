"""Self-describing blob for one request's compressed KV.

Layout (little-endian)::

    0   4  magic  b"KVTX"
    4   1  version (1)
    5   1  flags (0, reserved)
    6   4  header length h
    10  h  header: UTF-8 JSON {"spec": str, "entries": [{"key", "shape", "dtype", "meta",
                               "streams": [{"name", "dtype", "shape", "bits", "bf16", "n"}]}]}
    ..     payload: every stream's coded bytes, in header order (n bytes each)
    -8  8  XXH3-64 of everything before it (version 1, still read: a 4-byte CRC-32)

Parsing is bounded: the header is at most ``MAX_HEADER_BYTES``, every field has an exact type (ints are
JSON integers, no NaN/Infinity, no duplicate keys), shapes have at most ``MAX_NDIM`` non-negative dims, a
stream holds at most as many values as its entry, and all entries together at most ``max_values`` values
(default ``MAX_VALUES``), checked before anything is decoded. Anything that does not parse, or whose
checksum, lengths or types disagree, raises ContainerError naming the field.

A stream's payload may be a device tensor (uint8): ``pack`` copies runs of them to the host in one transfer each,
straight into the blob, which it returns as a bytearray (no further copy); ``pack_into`` writes into a buffer
the caller owns (a sender's registered staging memory). ``unpack`` hands out payloads as
zero-copy memoryviews of the blob.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .errors import ContainerError

MAGIC = b"KVTX"
VERSION = 2
SUM_BYTES = {1: 4, 2: 8}  # checksum bytes per container version
_HEAD = struct.Struct("<4sBBI")

MAX_VALUES = 1 << 30  # values (BF16: 2 GiB) all entries of one container may declare, unless the caller says otherwise
MAX_HEADER_BYTES = 16 << 20
MAX_NDIM = 8
MAX_DIM = 1 << 48
MAX_STREAMS = 1024  # per entry (a quantizer writes at most 4 per K|V and bit class)
STREAM_DTYPES = ("|u1", "<u2", "<f2", "<f4")  # numpy dtype strings the stages write


@dataclass
class StreamRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bits: int | None
    bf16: bool
    payload: bytes | bytearray | memoryview | torch.Tensor  # a tensor: uint8, on any device (pack only)


@dataclass
class Entry:
    key: str | None
    shape: tuple[int, ...]
    dtype: str
    meta: dict[str, Any] = field(default_factory=dict)
    streams: list[StreamRecord] = field(default_factory=list)


def checksum(body: bytes | bytearray | memoryview, version: int = VERSION) -> bytes:
    """The checksum a container of ``version`` ends with, over ``body`` (everything before it)."""
    if version == 1:
        return struct.pack("<I", zlib.crc32(body))
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _nbytes(p: Any) -> int:
    return p.numel() if isinstance(p, torch.Tensor) else len(p)


def _header(spec: str, entries: list[Entry], sizes: list[int]) -> bytes:
    it = iter(sizes)
    header = {
        "spec": spec,
        "entries": [
            {"key": e.key, "shape": list(e.shape), "dtype": e.dtype, "meta": e.meta,
             "streams": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "bits": s.bits,
                          "bf16": s.bf16, "n": next(it)} for s in e.streams]}
            for e in entries
        ],
    }
    hb = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return _HEAD.pack(MAGIC, VERSION, 0, len(hb)) + hb


def _payloads(entries: list[Entry]) -> tuple[list[Any], list[int]]:
    payloads = [s.payload for e in entries for s in e.streams]
    for p in payloads:
        if isinstance(p, torch.Tensor) and p.dtype != torch.uint8:
            raise TypeError(f"a tensor payload must be uint8, got {p.dtype}")
    return payloads, [_nbytes(p) for p in payloads]


def pack(spec: str, entries: list[Entry]) -> bytearray:
    payloads, sizes = _payloads(entries)
    head = _header(spec, entries, sizes)
    out = bytearray(len(head) + sum(sizes) + SUM_BYTES[VERSION])
    _write(memoryview(out), head, payloads, sizes)
    return out


def pack_into(out: Any, spec: str, entries: list[Entry]) -> int:
    """Write the container into the writable buffer ``out`` (its first bytes); returns its length. ``ValueError``
    (nothing written) if it does not fit. Payload copies run in torch, which releases the GIL: a sender thread
    packing megabytes does not hold up the server's other threads."""
    payloads, sizes = _payloads(entries)
    head = _header(spec, entries, sizes)
    total = len(head) + sum(sizes) + SUM_BYTES[VERSION]
    view = memoryview(out).cast("B")
    if view.readonly or total > view.nbytes:
        raise ValueError(f"the container takes {total} bytes; the buffer is "
                         f"{'read-only' if view.readonly else f'{view.nbytes} bytes'}")
    _write(view[:total], head, payloads, sizes)
    return total


def _write(view: memoryview, head: bytes, payloads: list[Any], sizes: list[int]) -> None:
    """Header, payloads and checksum into ``view``, exactly the container's length."""
    view[:len(head)] = head
    host = torch.frombuffer(view, dtype=torch.uint8)
    off, i = len(head), 0
    while i < len(payloads):
        p = payloads[i]
        if isinstance(p, torch.Tensor):  # a run of tensors on one device: one copy into the blob
            j = i
            while j < len(payloads) and isinstance(payloads[j], torch.Tensor) and payloads[j].device == p.device:
                j += 1
            n = sum(sizes[i:j])
            run = [t.reshape(-1) for t in payloads[i:j] if t.numel()]
            if n:
                host[off:off + n].copy_(run[0] if len(run) == 1 else torch.cat(run))
            off, i = off + n, j
            continue
        if sizes[i]:
            src = memoryview(p).cast("B")
            if src.readonly:  # torch wraps only writable buffers: a read-only payload (coded bytes) is copied here
                view[off:off + sizes[i]] = src
            else:
                host[off:off + sizes[i]].copy_(torch.frombuffer(src, dtype=torch.uint8))
        off, i = off + sizes[i], i + 1
    end = len(view) - SUM_BYTES[VERSION]
    view[end:] = checksum(view[:end])


def unpack(blob: bytes | bytearray | memoryview, max_values: int = MAX_VALUES) -> tuple[str, list[Entry]]:
    """Parse and check a container; ``max_values`` bounds the values all its entries may declare."""
    if isinstance(max_values, bool) or not isinstance(max_values, int) or max_values < 0:
        raise ValueError(f"max_values must be an int >= 0, got {max_values!r}")
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ContainerError(f"blob must be bytes, got {type(blob).__name__}")
    try:
        b = memoryview(blob).cast("B")
    except TypeError as ex:
        raise ContainerError(f"blob must be a contiguous byte buffer: {ex}") from ex
    if len(b) < _HEAD.size + 4:
        raise ContainerError(f"blob too short ({len(b)} bytes) to be a kvtide transfer container")
    magic, version, flags, hlen = _HEAD.unpack_from(b, 0)
    if magic != MAGIC:
        raise ContainerError(f"not a kvtide transfer container (magic {bytes(magic)!r})")
    if version not in SUM_BYTES:
        raise ContainerError(f"unsupported container version {version} (this build reads {sorted(SUM_BYTES)})")
    k = SUM_BYTES[version]
    if len(b) < _HEAD.size + k:
        raise ContainerError(f"blob too short ({len(b)} bytes) to be a version {version} container")
    if checksum(b[:-k], version) != b[-k:]:
        raise ContainerError("checksum mismatch: blob damaged or truncated")
    if flags != 0:
        raise ContainerError(f"container flags: expected 0, got {flags}")
    if hlen > MAX_HEADER_BYTES or _HEAD.size + hlen > len(b) - k:
        raise ContainerError(f"header length {hlen}: expected at most {min(MAX_HEADER_BYTES, len(b) - k - _HEAD.size)}")
    header = _load_json(bytes(b[_HEAD.size: _HEAD.size + hlen]))
    spec, raw_entries = _fields(header, "header", {"spec": str, "entries": list})
    if not raw_entries:
        raise ContainerError("header.entries: expected at least one entry, got none")
    off, end, total = _HEAD.size + hlen, len(b) - k, 0
    entries: list[Entry] = []
    for i, e in enumerate(raw_entries):
        entry, off = _entry(e, f"entries[{i}]", b, off, end)
        total += math.prod(entry.shape)
        if total > max_values:
            raise ContainerError(f"entries[0..{i}] declare {total} values, more than max_values={max_values}")
        entries.append(entry)
    if off != end:
        raise ContainerError(f"{end - off} unaccounted payload bytes")
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys) or (None in keys and len(keys) > 1):
        shown = [k if k is None else k[:40] for k in keys[:8]]
        raise ContainerError(f"entry keys must be distinct (and null only for a single entry), got {shown}")
    return spec, entries


def _entry(e: Any, where: str, b: memoryview, off: int, end: int) -> tuple[Entry, int]:
    key, shape, dtype, meta, streams = _fields(
        e, where, {"key": (str, type(None)), "shape": list, "dtype": str, "meta": dict, "streams": list})
    shape = _shape(shape, f"{where}.shape")
    if len(streams) > MAX_STREAMS:
        raise ContainerError(f"{where}.streams: expected at most {MAX_STREAMS}, got {len(streams)}")
    numel = math.prod(shape)
    recs, names = [], set()
    for j, s in enumerate(streams):
        w = f"{where}.streams[{j}]"
        name, sdt, sshape, bits, bf16, n = _fields(s, w, {"name": str, "dtype": str, "shape": list,
                                                          "bits": (int, type(None)), "bf16": bool, "n": int})
        sshape = _shape(sshape, f"{w}.shape")
        if name in names:
            raise ContainerError(f"{w}.name: {name!r} repeats an earlier stream")
        names.add(name)
        if sdt not in STREAM_DTYPES:
            raise ContainerError(f"{w}.dtype: expected one of {STREAM_DTYPES}, got {sdt[:40]!r}")
        if bits is not None and (not 1 <= bits <= 8 or sdt != "|u1"):
            raise ContainerError(f"{w}.bits: expected 1..8 on a '|u1' stream, got {bits} on {sdt!r}")
        if bf16 and (sdt != "<u2" or bits is not None):
            raise ContainerError(f"{w}.bf16: expected only on a '<u2' stream without bits, got {sdt!r} bits={bits}")
        if math.prod(sshape) > numel:
            raise ContainerError(f"{w}.shape: {list(sshape)} holds more values than its entry {list(shape)}")
        if not 0 <= n <= end - off:
            raise ContainerError(f"{w}.n: {n} bytes run past the end of the blob ({end - off} left)")
        recs.append(StreamRecord(name, sdt, sshape, bits, bf16, b[off: off + n]))
        off += n
    return Entry(key, shape, dtype, meta, recs), off


def _load_json(raw: bytes) -> Any:
    def no_constant(name: str) -> Any:
        raise ContainerError(f"header: {name} is not allowed")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ContainerError(f"header: repeated key in object with keys {[k for k, _ in pairs][:8]}")
        return d

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant, object_pairs_hook=no_duplicates)
    except ContainerError:
        raise
    except RecursionError as ex:
        raise ContainerError("header: JSON nested too deeply") from ex
    except ValueError as ex:  # UnicodeDecodeError, JSONDecodeError, over-long integer literals
        raise ContainerError(f"header: not valid JSON ({str(ex)[:120]})") from ex


def _fields(obj: Any, where: str, spec: dict[str, type | tuple[type, ...]]) -> list[Any]:
    """The values of exactly the keys of ``spec``, each of its type (bool is not an int here)."""
    if not isinstance(obj, dict):
        raise ContainerError(f"{where}: expected an object, got {type(obj).__name__}")
    if set(obj) != set(spec):
        raise ContainerError(f"{where}: expected keys {sorted(spec)}, got {sorted(obj)[:12]}")
    out = []
    for k, t in spec.items():
        v = obj[k]
        ts = t if isinstance(t, tuple) else (t,)
        if not isinstance(v, ts) or (isinstance(v, bool) and bool not in ts):
            names = " or ".join("null" if x is type(None) else x.__name__ for x in ts)
            raise ContainerError(f"{where}.{k}: expected {names}, got {type(v).__name__}")
        out.append(v)
    return out


def _shape(dims: list[Any], where: str) -> tuple[int, ...]:
    if len(dims) > MAX_NDIM:
        raise ContainerError(f"{where}: expected at most {MAX_NDIM} dims, got {len(dims)}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DIM:
            raise ContainerError(f"{where}: expected ints in [0, 2**48], got {repr(d)[:40]}")
    return tuple(dims)
