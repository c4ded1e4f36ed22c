"""Store interface, errors, counters and the record format of one (chunk, layer) KV entry.

Granularity: one entry per (chunk, layer block), not one record per chunk with per-layer offsets. A plan
loads layers [i, L) of chunk c, and separate entries make that a plain GET on every tier (memory, file,
Redis) with no ranged-read support needed; each entry has its own checksum, so a corrupt layer costs a
recompute of that layer's tokens only; entries can be written as soon as each layer's KV exists; and the
Redis tier can fetch many with one MGET. The price is L small headers (~150 B against >= 12 KiB of KV).

Record format, version 3 (all little endian)::

    0   4  magic  b"KVTR"
    4   2  version (u16) = 3
    6   2  flags (u16) = 0, reserved
    8   4  meta_len (u32)
    12  8  body_len (u64)              = 4 * num_tokens + payload bytes
    20  16 checksum of meta || body: XXH3-128 (xxhash), little endian
    36  meta: UTF-8 JSON {"key", "layer", "dtype", "shape", "num_tokens", "byteorder"[, "codec", "block_size"]},
        space-padded so the payload starts on a 64-byte boundary of the record (zero-copy views, aligned copies)
        body: token ids (u32) then the KV tensor's raw bytes (C order), e.g. [2, tokens, kv_heads, head_dim] BF16;
        with ``"codec": "zip1"`` the same KV in the ZipFusion format instead (:mod:`kvtide.store.zip_entry`)

Versions 1 (blake2b-128, no padding) and 2 (CRC-32 then 12 zero bytes) are still read. The load path is bound by
checksum speed: blake2b ran 0.6 GB/s a core, zlib's CRC-32 1.6 (this 2-core CPU), XXH3-128 18 GB/s. With CRC-32 a
GPU restoration needed 8 verify threads to keep up with a 40 Gbps link, and those threads slowed the compute
thread's kernel launches ~2x (the H200 probe, bench/restore_probe.py: F learned under loads sat 2x above F alone);
XXH3 verifies at link speed on one thread. It is an integrity check against torn, truncated or flipped bytes
(all but ~2^-128 of random damage), not a defence against a forger; the chunk keys stay blake2b. The token ids in
the body are still compared on every hit.

Loads in bulk: ``fetch`` reads the raw bytes of many entries in one round trip (one lock, one MGET) and says when
they are across the link (``ready_at``; a ``BandwidthLimitedStore`` reserves the link then, so the next fetch
travels while the caller verifies this one); ``open`` verifies and decodes one of them, optionally without a copy.

A short read is ``ChunkTruncated``; bad magic/version/length/digest/shape is ``ChunkCorrupt``; token ids
that differ from the caller's is ``TokenMismatch``; an absent entry ``ChunkMissing``; a tier that cannot
be reached ``StoreUnavailable``. All are ``StoreError``: the caller recomputes what it could not load.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import struct
import sys
import threading
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import xxhash

from kvtide.store.keys import ChunkKey, token_bytes
from kvtide.store.zip_entry import CODEC as ZIP_CODEC
from kvtide.store.zip_entry import ZipEntry, check_payload

RECORD_MAGIC = b"KVTR"
RECORD_VERSION = 3  # written; READ_VERSIONS are read
READ_VERSIONS = (1, 2, 3)
_HEADER = struct.Struct("<4sHHIQ16s")
HEADER_BYTES = _HEADER.size  # 36
PAYLOAD_ALIGN = 64

# Zero-copy views of immutable ``bytes`` are only ever read (copied into pages). torch warns once per process
# that such a tensor is not write-protected: take that one warning here, silenced, instead of in a load.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0", dtype=torch.uint8)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {v: torch.empty(0, dtype=v).element_size() for v in DTYPES.values()}


_U32 = next((c for c in "IL" if array.array(c).itemsize == 4), "")


def token_array(tokens: Sequence[int]) -> Sequence[int]:
    """The ids as a uint32 ``array`` (still a sequence of ints, sliced like a list), for a loader that checks many
    entries of one request: converted once here, each entry's check is then a byte copy (``_token_bytes_fast``)
    instead of a conversion of the chunk's ids. Ids that do not fit, or a big-endian host: returned unchanged."""
    if _U32 and sys.byteorder == "little" and isinstance(tokens, (list, tuple)):
        try:
            return array.array(_U32, tokens)
        except (OverflowError, TypeError):
            pass
    return tokens


def _token_bytes_fast(tokens: Sequence[int] | np.ndarray) -> bytes:
    """``token_bytes`` for the hot path: a ``token_array`` slice as its bytes (~0.2 us for a 512-token chunk), a list
    of ints through ``array`` (~5 us; out-of-range ids raise OverflowError there too); anything else, or a big-endian
    host, through the general version."""
    if _U32 and sys.byteorder == "little":
        if isinstance(tokens, array.array) and tokens.typecode == _U32:
            return tokens.tobytes()
        if isinstance(tokens, (list, tuple)):
            try:
                return array.array(_U32, tokens).tobytes()
            except (OverflowError, TypeError):
                pass
    return token_bytes(tokens)


class StoreError(Exception):
    """Any failure to produce a verified entry; callers fall back to recompute."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class ChunkMissing(StoreError):
    """The entry is not in this store."""


class ChunkCorrupt(StoreError):
    """The entry exists but fails a check (magic, version, length, checksum, shape, key)."""


class ChunkTruncated(ChunkCorrupt):
    """The entry is shorter than its header says."""


class TokenMismatch(ChunkCorrupt):
    """The entry is intact but holds other token ids than the caller's prefix (collision or mix-up)."""


class StoreUnavailable(StoreError):
    """The tier cannot be reached (server down, disk unreadable)."""


@dataclass
class StoreStats:
    """Counters of what a store did; every fallback cause is counted separately."""

    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    truncated: int = 0
    token_mismatch: int = 0
    unavailable: int = 0
    evictions: int = 0
    rejected: int = 0  # entries larger than the whole store
    bytes_written: int = 0
    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @property
    def fallbacks(self) -> int:
        return self.misses + self.corrupt + self.truncated + self.token_mismatch + self.unavailable


@dataclass(frozen=True)
class Entry:
    """A verified entry: the KV tensor (or, opened with ``decode=False``, its ``ZipEntry``) and the record's size on
    the wire."""

    tensor: "torch.Tensor | ZipEntry"
    nbytes: int


def _digest(meta: bytes | memoryview, body: bytes | memoryview, version: int = RECORD_VERSION) -> bytes:
    """The 16-byte checksum field of a record of ``version``."""
    if version == 3:
        h = xxhash.xxh3_128()
        h.update(meta)
        h.update(body)
        return h.intdigest().to_bytes(16, "little")
    if version == 1:
        b = hashlib.blake2b(digest_size=16)
        b.update(meta)
        b.update(body)
        return b.digest()
    return (zlib.crc32(body, zlib.crc32(meta)) & 0xFFFFFFFF).to_bytes(4, "little") + bytes(12)


def encode_record(
    key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: "torch.Tensor | ZipEntry",
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> memoryview:
    """Serialise one (chunk, layer) entry; returns a read-only byte view of the record.

    ``kv``: the KV tensor, or a ``ZipEntry`` (the same KV in the ZipFusion format, encoded by the caller on its
    device; stored with ``codec: "zip1"``, see :mod:`kvtide.store.zip_entry`).
    ``alloc(nbytes)``: the uint8 CPU tensor to build the record in (a tier's own slot, which saves a copy);
    default a fresh one.

    Built in one torch-allocated buffer: the KV is copied straight into its payload slot by a torch copy and
    hashed by xxhash, both of which release the GIL. A ``b"".join`` of the parts allocates, faults in and copies
    megabytes with the GIL held, and a background writer doing that makes every torch call of the engine thread
    wait for it (``bench/writer_interference.py``: steps of small torch calls 5.9x slower while the writer drains
    8B-shape records that way, 1.2x with this encoder).
    """
    zipped = isinstance(kv, ZipEntry)
    if not zipped and not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor or a ZipEntry, got {type(kv).__name__}")
    if kv.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; one of {sorted(DTYPES)}")
    shape = list(kv.shape)
    tok = token_bytes(tokens)
    n_tok = len(tok) // 4
    if len(shape) < 2 or shape[0] != 2 or shape[1] != n_tok:
        raise ValueError(f"kv must be [2, {n_tok} tokens, ...] (K and V), got {shape}")
    fields_ = {"key": key.hex, "layer": int(layer), "dtype": _DTYPE_NAMES[kv.dtype], "shape": shape,
               "num_tokens": n_tok, "byteorder": sys.byteorder}
    if zipped:
        if kv.num_blocks * kv.block_size != math.prod(shape):
            raise ValueError(f"ZipEntry of {kv.num_blocks} blocks of {kv.block_size} does not hold {shape}")
        fields_.update(codec=ZIP_CODEC, block_size=kv.block_size)
        packed = kv.packed_nbytes()
        if kv.data.numel() < packed:
            raise ValueError(f"ZipEntry data holds {kv.data.numel()} bytes, its descriptors say {packed}")
        desc_nbytes = -(-kv.num_blocks // 16) * 16
        nbytes = desc_nbytes + packed
    else:
        nbytes = kv.numel() * kv.element_size()
    meta = json.dumps(fields_, separators=(",", ":")).encode()
    meta += b" " * (-(HEADER_BYTES + len(meta) + len(tok)) % PAYLOAD_ALIGN)  # JSON ignores trailing blanks
    start = HEADER_BYTES + len(meta) + len(tok)  # payload offset, a multiple of PAYLOAD_ALIGN
    buf = torch.empty(start + nbytes, dtype=torch.uint8) if alloc is None else alloc(start + nbytes)
    if buf.dtype != torch.uint8 or buf.device.type != "cpu" or buf.numel() != start + nbytes or not buf.is_contiguous():
        raise ValueError(f"alloc must return a contiguous CPU uint8 tensor of {start + nbytes} bytes")
    arr = buf.numpy()
    arr[HEADER_BYTES:HEADER_BYTES + len(meta)] = np.frombuffer(meta, np.uint8)
    arr[HEADER_BYTES + len(meta):start] = np.frombuffer(tok, np.uint8)
    if zipped:
        nb = kv.num_blocks
        buf[start:start + nb].copy_(kv.desc.reshape(-1))
        buf[start + nb:start + desc_nbytes].zero_()
        buf[start + desc_nbytes:].copy_(kv.data[:packed])
    elif nbytes:
        buf[start:].view(kv.dtype).view(kv.shape).copy_(kv.detach())
    digest = _digest(arr[HEADER_BYTES:HEADER_BYTES + len(meta)], arr[HEADER_BYTES + len(meta):])
    _HEADER.pack_into(arr, 0, RECORD_MAGIC, RECORD_VERSION, 0, len(meta), len(tok) + nbytes, digest)
    arr.flags.writeable = False
    return memoryview(arr)


# Metadata after its key and layer (dtype, shape, token count, byte order: the same for every entry of a model),
# parsed once: a JSON parse per entry was ~5 us of the ~40 us of GIL-held work of a load's verify. Bounded.
_META_TAILS: dict[bytes, tuple[torch.dtype, tuple[int, ...], int, str | None, int]] = {}
_META_TAILS_MAX = 256


def _read_meta(meta: bytes, key: ChunkKey, layer: int, name: str
               ) -> tuple[torch.dtype, list[int], int, str | None, int]:
    """(dtype, shape, num_tokens, codec, block size) of a record's metadata, checked against the caller's key and
    layer (codec None: the payload is the tensor's raw bytes).

    Fast path: ``encode_record`` writes the key and layer first, so metadata that starts with exactly the expected
    ``{"key":"<hex>","layer":<n>,`` and ends in a tail already parsed (and checked) is that entry's. Tails naming a
    key or a layer again, or holding an escape, are never cached (JSON would let a later value win), so anything else
    takes the full parse.
    """
    prefix = b'{"key":"%s","layer":%d,' % (key.hex.encode(), layer)
    if meta.startswith(prefix):
        hit = _META_TAILS.get(meta[len(prefix):])
        if hit is not None:
            return hit[0], list(hit[1]), hit[2], hit[3], hit[4]
    try:
        parsed = json.loads(meta)
        dtype = DTYPES[parsed["dtype"]]
        shape = [int(x) for x in parsed["shape"]]
        n_tok = int(parsed["num_tokens"])
        codec = parsed.get("codec")
        block_size = int(parsed.get("block_size", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise ChunkCorrupt(f"{name}: unreadable metadata ({e})", name) from None
    if parsed.get("key") != key.hex or parsed.get("layer") != layer:
        raise ChunkCorrupt(f"{name}: entry is for {parsed.get('key')}.{parsed.get('layer')}", name)
    if parsed.get("byteorder", "little") != sys.byteorder:
        raise ChunkCorrupt(f"{name}: written on a {parsed.get('byteorder')}-endian host", name)
    if codec not in (None, ZIP_CODEC):
        raise ChunkCorrupt(f"{name}: unknown codec {codec!r}", name)
    if codec is not None and dtype != torch.bfloat16:
        raise ChunkCorrupt(f"{name}: codec {codec} holds bfloat16, metadata says {parsed['dtype']}", name)
    tail = meta[len(prefix):]
    if (meta.startswith(prefix) and b'"key"' not in tail and b'"layer"' not in tail and b"\\" not in tail
            and len(_META_TAILS) < _META_TAILS_MAX):
        _META_TAILS[tail] = (dtype, tuple(shape), n_tok, codec, block_size)
    return dtype, shape, n_tok, codec, block_size


def decode_record(
    blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, name: str = "", *, copy: bool = True,
    decode: bool = True,
) -> "torch.Tensor | ZipEntry":
    """Verify and deserialise an entry; raises the specific ``StoreError`` for each failed check.

    ``copy=False`` returns a read-only view of ``blob`` (it keeps ``blob`` alive): for callers that copy the KV
    into place at once, which saves one copy of every loaded byte. ``decode=False``: an entry stored in the
    ZipFusion format comes back as that ``ZipEntry`` (its descriptors and lengths checked), for a caller that
    decodes on its device; with True it is decoded here (torch, on the CPU: slow, for tests and small models).
    """
    if len(blob) < HEADER_BYTES:
        raise ChunkTruncated(f"{name}: {len(blob)} bytes, shorter than the {HEADER_BYTES}-byte header", name)
    magic, version, _flags, meta_len, body_len, digest = _HEADER.unpack_from(blob)
    if magic != RECORD_MAGIC:
        raise ChunkCorrupt(f"{name}: bad magic {magic!r}", name)
    if version not in READ_VERSIONS:
        raise ChunkCorrupt(f"{name}: record version {version}, this build reads {READ_VERSIONS}", name)
    want = HEADER_BYTES + meta_len + body_len
    if len(blob) < want:
        raise ChunkTruncated(f"{name}: {len(blob)} bytes, header says {want}", name)
    if len(blob) > want:
        raise ChunkCorrupt(f"{name}: {len(blob)} bytes, header says {want}", name)
    view = memoryview(blob)
    meta_b = view[HEADER_BYTES : HEADER_BYTES + meta_len]
    body = view[HEADER_BYTES + meta_len :]
    # v3 digests meta || body, which lie back to back from the header on: one XXH3 call over them is ~10% faster than
    # the streaming update of _digest (2 MiB entries, in cache or not), and it releases the GIL the same way
    got = xxhash.xxh3_128_intdigest(view[HEADER_BYTES:]).to_bytes(16, "little") if version == 3 \
        else _digest(meta_b, body, version)
    if got != digest:
        raise ChunkCorrupt(f"{name}: checksum mismatch", name)
    dtype, shape, n_tok, codec, block_size = _read_meta(bytes(meta_b), key, layer, name)
    try:
        expect_tok = _token_bytes_fast(tokens)
    except (OverflowError, ValueError) as e:
        raise TokenMismatch(f"{name}: the request's token ids cannot be stored ids ({e})", name) from None
    if body[: 4 * n_tok].tobytes() != expect_tok:  # a memoryview compared with bytes goes item by item: ~20x slower
        raise TokenMismatch(f"{name}: stored token ids differ from the request's prefix", name)
    payload = body[4 * n_tok :]
    if codec is not None:
        return _zip_entry(blob, payload, HEADER_BYTES + meta_len + 4 * n_tok, shape, block_size, name, copy, decode)
    itemsize = _ITEMSIZE[dtype]
    if len(payload) != itemsize * math.prod(shape):
        raise ChunkCorrupt(f"{name}: payload {len(payload)} bytes does not match {_DTYPE_NAMES[dtype]}{shape}", name)
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    if copy:
        return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape)
    off = HEADER_BYTES + meta_len + 4 * n_tok
    return torch.frombuffer(blob, dtype=dtype, count=len(payload) // itemsize, offset=off).reshape(shape)


def _zip_entry(blob: bytes, payload: memoryview, off: int, shape: list[int], block_size: int, name: str, copy: bool,
               decode: bool) -> "torch.Tensor | ZipEntry":
    """The ``ZipEntry`` (or its decoded tensor) of a verified ``zip1`` payload at byte ``off`` of ``blob``."""
    numel = math.prod(shape)
    nb = numel // block_size if block_size > 0 else 0
    desc = np.frombuffer(payload, np.uint8, count=min(nb, len(payload)))
    why = check_payload(desc, len(payload), numel, block_size)
    if why is not None:
        raise ChunkCorrupt(f"{name}: {why}", name)
    if copy:
        span = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        span = torch.frombuffer(blob, dtype=torch.uint8, count=len(payload), offset=off)
    e = ZipEntry(None, None, tuple(shape), block_size, span)
    return e.decode() if decode else e


@dataclass
class Fetched:
    """Raw bytes of several entries read in one round trip (or the error of each that could not be read).

    ``ready_at`` (``time.perf_counter()`` clock) is when the bytes are across the link: a caller that waits for
    it before ``open`` lets the next fetch travel while it verifies and places this one.
    """

    names: list[str]
    blobs: list[bytes | StoreError]
    nbytes: int
    ready_at: float = 0.0
    # Blobs that are views of a tier's own memory (``PinnedMemoryStore``) stay valid until ``release``; ``pinned``:
    # that memory is page-locked, so a device may copy straight out of it (DMA) before the release.
    lease: Any = None
    pinned: bool = False

    def release(self, after: Any = None) -> None:
        """Hand the tier its memory back, at once or once ``after.query()`` is true (a device copy still reading
        it, e.g. a ``torch.cuda.Event`` recorded behind that copy). Idempotent; a no-op for tiers of plain bytes."""
        if self.lease is not None:
            self.lease.release(after)

    def wait(self) -> float:
        """Sleep until the bytes have arrived; returns the seconds slept."""
        dt = self.ready_at - time.perf_counter()
        if dt > 0:
            time.sleep(dt)
            return dt
        return 0.0


class KVStore(ABC):
    """A tier of (chunk, layer) entries. Subclasses move bytes; this class formats, verifies and counts."""

    def __init__(self, drop_bad: bool = True) -> None:
        self.stats = StoreStats()
        self.drop_bad = drop_bad  # delete an entry that failed a check so it is rewritten, not re-failed

    # ---- raw byte storage, per tier
    @abstractmethod
    def _write(self, name: str, blob: bytes) -> bool | None:
        """Store the bytes; return False if the tier declined them (too large), else None/True."""

    @abstractmethod
    def _read(self, name: str) -> bytes:
        """The stored bytes; ChunkMissing if absent, StoreUnavailable if the tier cannot be reached."""

    @abstractmethod
    def _delete(self, name: str) -> None: ...

    @abstractmethod
    def _exists(self, name: str) -> bool: ...

    def _read_many(self, names: Sequence[str]) -> list[bytes | None]:
        """Bytes per name, None where missing (tiers with batched reads override)."""
        out: list[bytes | None] = []
        for n in names:
            try:
                out.append(self._read(n))
            except ChunkMissing:
                out.append(None)
        return out

    # ---- public API
    def put(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        """Store one entry; returns its size in bytes. Raises StoreUnavailable if the tier is down."""
        blob = encode_record(key, layer, tokens, kv)
        try:
            stored = self._write(key.entry_name(layer), blob)
        except StoreUnavailable:
            self.stats.add(put_failures=1, unavailable=1)
            raise
        if stored is False:
            return 0
        self.stats.add(puts=1, bytes_written=len(blob))
        return len(blob)

    def get_entry(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray) -> Entry:
        """Load and verify one entry (raises a StoreError subclass, counted, on any failure)."""
        name = key.entry_name(layer)
        try:
            blob = self._read(name)
        except StoreError as e:
            self._count(e)
            raise
        return self._verify(blob, key, layer, tokens, name)

    def get(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
        return self.get_entry(key, layer, tokens).tensor

    def get_layers(
        self, key: ChunkKey, layers: Iterable[int], tokens: Sequence[int] | np.ndarray
    ) -> dict[int, torch.Tensor | StoreError]:
        """Several layers of one chunk; each value is the tensor or the (counted) error for that layer."""
        return {
            i: (e.tensor if isinstance(e, Entry) else e) for i, e in self.get_layer_entries(key, layers, tokens).items()
        }

    def get_layer_entries(
        self, key: ChunkKey, layers: Iterable[int], tokens: Sequence[int] | np.ndarray
    ) -> dict[int, Entry | StoreError]:
        """Like ``get_layers`` with record sizes (what a link would carry)."""
        layers = list(layers)
        names = [key.entry_name(i) for i in layers]
        try:
            blobs = self._read_many(names)
        except StoreUnavailable as e:
            self.stats.add(unavailable=len(layers))
            return {i: e for i in layers}
        out: dict[int, Entry | StoreError] = {}
        for i, n, blob in zip(layers, names, blobs):
            if blob is None:
                err = ChunkMissing(f"{n}: not in store", n)
                self._count(err)
                out[i] = err
                continue
            try:
                out[i] = self._verify(blob, key, i, tokens, n)
            except StoreError as e:
                out[i] = e
        return out

    def fetch(self, items: Sequence[tuple[ChunkKey, int]]) -> Fetched:
        """Raw bytes of the (key, layer) entries in one round trip; missing or unreachable ones as (counted) errors."""
        names = [k.entry_name(layer) for k, layer in items]
        try:
            raw = self._read_many(names)
        except StoreUnavailable as e:
            self.stats.add(unavailable=len(names))
            return Fetched(names, [e] * len(names), 0, time.perf_counter())
        return self._fetched(names, raw)

    def _fetched(self, names: list[str], raw: Sequence[bytes | None], **kw: Any) -> Fetched:
        """A ``Fetched`` of read bytes, each missing one (None) as a counted ``ChunkMissing``."""
        blobs: list[bytes | StoreError] = []
        for n, b in zip(names, raw):
            if b is None:
                err = ChunkMissing(f"{n}: not in store", n)
                self._count(err)
                blobs.append(err)
            else:
                blobs.append(b)
        nbytes = sum(len(b) for b in blobs if not isinstance(b, StoreError))
        return Fetched(names, blobs, nbytes, time.perf_counter(), **kw)

    def open(
        self, blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, *, copy: bool = True,
        decode: bool = True,
    ) -> Entry:
        """Verify and decode one fetched entry (counted like ``get_entry``); ``copy=False``: a view of ``blob``;
        ``decode=False``: an entry stored in the ZipFusion format stays a ``ZipEntry`` (``decode_record``)."""
        return self._verify(blob, key, layer, tokens, key.entry_name(layer), copy=copy, decode=decode)

    def contains(self, key: ChunkKey, layer: int) -> bool:
        try:
            return self._exists(key.entry_name(layer))
        except StoreUnavailable:
            self.stats.add(unavailable=1)
            return False

    def delete(self, key: ChunkKey, layer: int) -> None:
        self._delete(key.entry_name(layer))

    def close(self) -> None:
        """Release connections/handles (no-op by default)."""

    # ---- helpers
    def _verify(
        self, blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, name: str, copy: bool = True,
        decode: bool = True,
    ) -> Entry:
        try:
            t = decode_record(blob, key, layer, tokens, name, copy=copy, decode=decode)
        except StoreError as e:
            self._count(e)
            if self.drop_bad:
                try:
                    self._delete(name)
                except StoreError:
                    pass
            raise
        self.stats.add(hits=1, bytes_read=len(blob))
        return Entry(t, len(blob))

    def _count(self, e: StoreError) -> None:
        if isinstance(e, ChunkMissing):
            self.stats.add(misses=1)
        elif isinstance(e, TokenMismatch):
            self.stats.add(token_mismatch=1)
        elif isinstance(e, ChunkTruncated):
            self.stats.add(truncated=1)
        elif isinstance(e, ChunkCorrupt):
            self.stats.add(corrupt=1)
        elif isinstance(e, StoreUnavailable):
            self.stats.add(unavailable=1)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
