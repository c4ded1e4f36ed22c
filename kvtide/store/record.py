"""The record of one (chunk, layer) KV entry: encode, and verify-and-decode with every parse bounded.

Record format, version 4 (all little endian)::

    0   4  magic  b"KVTR"
    4   2  version (u16) = 4
    6   2  flags (u16): 1 KEYED (the digest is a MAC under the store secret), 2 TOKEN_HASH (the body holds a hash
           of the chunk's token ids instead of the ids); other bits must be 0
    8   4  meta_len (u32), at most META_MAX_BYTES
    12  8  body_len (u64)              = token section + payload bytes
    20  16 digest: KEYED: HMAC-SHA256/128 of bytes 0..20 || meta || body (:mod:`kvtide.store.auth`);
           else XXH3-128 of meta || body (xxhash), as in version 3
    36  meta: UTF-8 JSON {"key", "layer", "dtype", "shape", "num_tokens", "byteorder"[, "codec", "block_size"]},
        space-padded so the payload starts on a 64-byte boundary of the record (zero-copy views, aligned copies)
        body: token section (u32 ids, 4 * num_tokens bytes; or with TOKEN_HASH their 32-byte hash), then the KV
        tensor's raw bytes (C order), e.g. [2, tokens, kv_heads, head_dim] BF16; with ``"codec": "zip1"`` the same KV
        in the ZipFusion format instead (:mod:`kvtide.store.zip_entry`); with ``"codec": "kvs1"`` and ``"profile"`` (a
        pipeline spec) that profile's container blob of the KV (:mod:`kvtide.store.profile_entry`)

Versions 1 (blake2b-128, no padding), 2 (CRC-32 then 12 zero bytes) and 3 (v4 without flags) are read only by a
store without a secret. The unkeyed digest does not cover the header: its fields are checked against the record's
length, and a flipped flag or version bit fails the MAC, flag or token check instead. XXH3-128 because it verifies
an order of magnitude faster than blake2b or CRC-32, so the load path keeps link speed on one thread; it is an
integrity check against torn, truncated or flipped bytes (all but ~2^-128 of random damage), not a defence against
a forger: that is the secret's MAC (slower, GIL released; docs/design/store.md).

Parsing is bounded before anything is allocated: the caller's ``max_bytes`` (``record_bytes_bound``), the
metadata length, and every metadata field's type and range (JSON errors of any kind, deep nesting, NaN/Infinity,
negative or huge dims become ``ChunkCorrupt``); the record's dtype must be the caller's (``dtype``).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import math
import struct
import sys
import warnings
import zlib
from typing import Callable, Sequence

import numpy as np
import torch
import xxhash

from kvtide.store.auth import TOKEN_HASH_BYTES, RecordAuth, token_hash
from kvtide.store.errors import ChunkCorrupt, ChunkForged, ChunkOversize, ChunkTruncated, TokenMismatch
from kvtide.store.keys import ChunkKey, token_bytes
from kvtide.store.zip_entry import BLOCK_SIZE as ZIP_BLOCK_SIZE
from kvtide.store.zip_entry import CODEC as ZIP_CODEC
from kvtide.store.zip_entry import ZipEntry, check_payload, max_payload_nbytes
from kvtide.store.profile_entry import CODEC as PROFILE_CODEC
from kvtide.store.profile_entry import ProfileEntry, check_profile_name

RECORD_MAGIC = b"KVTR"
RECORD_VERSION = 4  # written; READ_VERSIONS are read
READ_VERSIONS = (1, 2, 3, 4)
FLAG_KEYED = 1
FLAG_TOKEN_HASH = 2
_KNOWN_FLAGS = FLAG_KEYED | FLAG_TOKEN_HASH
_HEADER = struct.Struct("<4sHHIQ16s")
HEADER_BYTES = _HEADER.size  # 36
_SIGNED = 20  # header bytes the MAC covers (all but the digest)
PAYLOAD_ALIGN = 64
META_MAX_BYTES = 64 << 10  # metadata above this is refused unparsed
_META_ALLOWANCE = 512  # metadata this build writes (under 200 bytes) and its padding: the record-size bound's share
_MAX_DIMS = 8
_MAX_DIM = 1 << 40

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
    """``token_bytes`` for the hot path: a ``token_array`` slice as its bytes (one copy), a list of ints through
    ``array`` (out-of-range ids raise OverflowError there too); anything else, or a big-endian host, through the
    general version."""
    if _U32 and sys.byteorder == "little":
        if isinstance(tokens, array.array) and tokens.typecode == _U32:
            return tokens.tobytes()
        if isinstance(tokens, (list, tuple)):
            try:
                return array.array(_U32, tokens).tobytes()
            except (OverflowError, TypeError):
                pass
    return token_bytes(tokens)


def record_bytes_bound(shape: Sequence[int], dtype: torch.dtype | None, num_tokens: int) -> int:
    """The most bytes a record of KV ``shape`` can take, as a reader's ``max_bytes``: header, metadata allowance,
    token section (ids or hash), and the plain payload of ``dtype`` (None: the widest stored dtype) or, for
    bfloat16, a ZipFusion payload with every block raw, whichever is larger."""
    numel = math.prod(shape)
    itemsize = _ITEMSIZE[dtype] if dtype is not None else max(_ITEMSIZE.values())
    payload = numel * itemsize
    if dtype in (None, torch.bfloat16):
        payload = max(payload, max_payload_nbytes(numel, ZIP_BLOCK_SIZE))
    return HEADER_BYTES + _META_ALLOWANCE + max(4 * num_tokens, TOKEN_HASH_BYTES) + payload


def _digest(meta: bytes | memoryview, body: bytes | memoryview, version: int = 3) -> bytes:
    """The 16-byte unkeyed checksum field of a record of ``version``."""
    if version >= 3:
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
    key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: "torch.Tensor | ZipEntry | ProfileEntry",
    alloc: Callable[[int], torch.Tensor] | None = None, *, auth: RecordAuth | None = None,
    store_token_ids: bool = True,
) -> memoryview:
    """Serialise one (chunk, layer) entry; returns a read-only byte view of the record.

    ``kv``: the KV tensor, or a ``ZipEntry`` (the same KV in the ZipFusion format, encoded by the caller on its
    device; stored with ``codec: "zip1"``, see :mod:`kvtide.store.zip_entry`), or a ``ProfileEntry`` (a KVServe
    profile's blob of it; ``codec: "kvs1"``, :mod:`kvtide.store.profile_entry`).
    ``alloc(nbytes)``: the uint8 CPU tensor to build the record in (a tier's own slot, which saves a copy);
    default a fresh one. ``auth``: sign the record with the store secret (flag KEYED). ``store_token_ids=False``:
    the record holds a hash of the token ids (keyed when ``auth`` is given) instead of the ids.

    Built in one torch-allocated buffer: the KV is copied straight into its payload slot by a torch copy and
    hashed by xxhash (or HMAC), all of which release the GIL. A ``b"".join`` of the parts allocates, faults in and
    copies megabytes with the GIL held, and a background writer doing that makes every torch call of the engine
    thread wait for it (``bench/writer_interference.py`` measures the difference).
    """
    zipped = isinstance(kv, ZipEntry)
    profiled = isinstance(kv, ProfileEntry)
    if not zipped and not profiled and not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, a ZipEntry or a ProfileEntry, got {type(kv).__name__}")
    if kv.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; one of {sorted(DTYPES)}")
    shape = list(kv.shape)
    tok = token_bytes(tokens)
    n_tok = len(tok) // 4
    if len(shape) < 2 or shape[0] != 2 or shape[1] != n_tok:
        raise ValueError(f"kv must be [2, {n_tok} tokens, ...] (K and V), got {shape}")
    flags = (FLAG_KEYED if auth is not None else 0) | (0 if store_token_ids else FLAG_TOKEN_HASH)
    if not store_token_ids:
        tok = token_hash(tok, auth)
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
    elif profiled:
        fields_.update(codec=PROFILE_CODEC, profile=kv.profile)
        nbytes = kv.nbytes
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
    elif profiled:
        arr[start:] = np.frombuffer(kv.blob, np.uint8)
    elif nbytes:
        buf[start:].view(kv.dtype).view(kv.shape).copy_(kv.detach())
    _HEADER.pack_into(arr, 0, RECORD_MAGIC, RECORD_VERSION, flags, len(meta), len(tok) + nbytes, bytes(16))
    if auth is not None:
        digest = auth.mac(arr[:_SIGNED].tobytes(), arr[HEADER_BYTES:])
    else:
        digest = xxhash.xxh3_128_intdigest(arr[HEADER_BYTES:]).to_bytes(16, "little")
    arr[_SIGNED:HEADER_BYTES] = np.frombuffer(digest, np.uint8)
    arr.flags.writeable = False
    return memoryview(arr)


# Metadata after its key and layer (dtype, shape, token count, byte order: the same for every entry of a model),
# parsed once: a JSON parse per entry would be a large share of the GIL-held work of a load's verify. Bounded.
_META_TAILS: dict[bytes, tuple[torch.dtype, tuple[int, ...], int, str | None, int, str | None]] = {}
_META_TAILS_MAX = 256


def _no_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def _int_field(parsed: dict, field: str, lo: int, hi: int, default: int | None = None) -> int:
    v = parsed.get(field, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{field} {v!r} is not an int in [{lo}, {hi}]")
    return v


def _parse_meta(meta: bytes) -> tuple[dict, torch.dtype, list[int], int, str | None, int, str | None]:
    """The metadata's fields, each of its type and range (ValueError naming the field otherwise)."""
    parsed = json.loads(meta, parse_constant=_no_constant, parse_float=lambda s: _no_constant(s))
    if not isinstance(parsed, dict):
        raise ValueError(f"metadata is a JSON {type(parsed).__name__}, expected an object")
    dtype_name = parsed.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    shape = parsed.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= _MAX_DIMS:
        raise ValueError(f"shape {shape!r} is not a list of 1 to {_MAX_DIMS} dims")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= _MAX_DIM:
            raise ValueError(f"shape {shape!r} has a dim that is not an int in [0, {_MAX_DIM}]")
    n_tok = _int_field(parsed, "num_tokens", 0, 1 << 31)
    codec = parsed.get("codec")
    if codec is not None and not isinstance(codec, str):
        raise ValueError(f"codec {codec!r} is not a string")
    block_size = _int_field(parsed, "block_size", 0, 1 << 31, default=0)
    profile = parsed.get("profile")
    if profile is not None and check_profile_name(profile) is not None:
        raise ValueError(check_profile_name(profile))
    layer = parsed.get("layer")
    if not isinstance(parsed.get("key"), str) or not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"key {parsed.get('key')!r} / layer {parsed.get('layer')!r} of the wrong type")
    if not isinstance(parsed.get("byteorder", "little"), str):
        raise ValueError(f"byteorder {parsed.get('byteorder')!r} is not a string")
    return parsed, DTYPES[dtype_name], list(shape), n_tok, codec, block_size, profile


def _read_meta(meta: bytes, key: ChunkKey, layer: int, name: str
               ) -> tuple[torch.dtype, list[int], int, str | None, int, str | None]:
    """(dtype, shape, num_tokens, codec, block size, profile) of a record's metadata, checked against the caller's
    key and layer (codec None: the payload is the tensor's raw bytes; profile: the spec of a ``kvs1`` record).

    Fast path: ``encode_record`` writes the key and layer first, so metadata that starts with exactly the expected
    ``{"key":"<hex>","layer":<n>,`` and ends in a tail already parsed (and checked) is that entry's. Tails naming a
    key or a layer again, or holding an escape, are never cached (JSON would let a later value win), so anything else
    takes the full parse.
    """
    prefix = b'{"key":"%s","layer":%d,' % (key.hex.encode(), layer)
    if meta.startswith(prefix):
        hit = _META_TAILS.get(meta[len(prefix):])
        if hit is not None:
            return hit[0], list(hit[1]), hit[2], hit[3], hit[4], hit[5]
    try:
        parsed, dtype, shape, n_tok, codec, block_size, profile = _parse_meta(meta)
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
        raise ChunkCorrupt(f"{name}: unreadable metadata ({type(e).__name__}: {str(e)[:120]})", name) from None
    if parsed.get("key") != key.hex or parsed.get("layer") != layer:
        raise ChunkCorrupt(f"{name}: entry is for {str(parsed.get('key'))[:40]}.{parsed.get('layer')}", name)
    if parsed.get("byteorder", "little") != sys.byteorder:
        raise ChunkCorrupt(f"{name}: written on a {str(parsed.get('byteorder'))[:20]}-endian host", name)
    if codec not in (None, ZIP_CODEC, PROFILE_CODEC):
        raise ChunkCorrupt(f"{name}: unknown codec {codec[:20]!r}", name)
    if (codec == PROFILE_CODEC) != (profile is not None):
        raise ChunkCorrupt(f"{name}: codec {codec!r} with profile {str(profile)[:40]!r}", name)
    if codec is not None and dtype != torch.bfloat16:
        raise ChunkCorrupt(f"{name}: codec {codec} holds bfloat16, metadata says {parsed['dtype']}", name)
    if len(shape) < 2 or shape[0] != 2 or shape[1] != n_tok:
        raise ChunkCorrupt(f"{name}: shape {shape} is not [2, {n_tok} tokens, ...]", name)
    tail = meta[len(prefix):]
    if (meta.startswith(prefix) and b'"key"' not in tail and b'"layer"' not in tail and b"\\" not in tail
            and len(_META_TAILS) < _META_TAILS_MAX):
        _META_TAILS[tail] = (dtype, tuple(shape), n_tok, codec, block_size, profile)
    return dtype, shape, n_tok, codec, block_size, profile


def _authenticate(view: memoryview, version: int, flags: int, digest: bytes, auth: RecordAuth | None,
                  name: str) -> None:
    """The record's MAC (a store with a secret) or unkeyed checksum (one without); raises on failure."""
    keyed = version == 4 and flags & FLAG_KEYED
    if auth is not None:
        if not keyed:
            raise ChunkForged(f"{name}: record version {version} carries no MAC and this store has a secret", name)
        if not hmac.compare_digest(auth.mac(view[:_SIGNED], view[HEADER_BYTES:]), digest):
            raise ChunkForged(f"{name}: MAC mismatch (another secret's record, or altered)", name)
        return
    if keyed:
        raise ChunkForged(f"{name}: record is signed with a secret and this store has none", name)
    # v3/v4 digest meta || body, which lie back to back from the header on: one XXH3 call over them is faster than
    # the streaming update of _digest, and it releases the GIL the same way
    if version >= 3:
        got = xxhash.xxh3_128_intdigest(view[HEADER_BYTES:]).to_bytes(16, "little")
    else:  # blake2b and CRC-32 of meta || body, streamed: the split between the two does not matter
        got = _digest(view[HEADER_BYTES:], b"", version)
    if got != digest:
        raise ChunkCorrupt(f"{name}: checksum mismatch", name)


def decode_record(
    blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, name: str = "", *, copy: bool = True,
    decode: bool = True, auth: RecordAuth | None = None, dtype: torch.dtype | None = None,
    max_bytes: int | None = None,
) -> "torch.Tensor | ZipEntry | ProfileEntry":
    """Verify and deserialise an entry; raises the specific ``StoreError`` for each failed check.

    ``copy=False`` returns a read-only view of ``blob`` (it keeps ``blob`` alive): for callers that copy the KV
    into place at once, which saves one copy of every loaded byte. ``decode=False``: an entry stored in the
    ZipFusion format comes back as that ``ZipEntry`` (its descriptors and lengths checked), for a caller that
    decodes on its device; with True it is decoded here (torch, on the CPU: slow, for tests and small models). The
    same for a profile's (``kvs1``) entry: a ``ProfileEntry``, or decoded here on the CPU (bounded by its shape).
    ``auth``: the store's secret keys (only records with its MAC pass); ``dtype``: the KV dtype the caller's pages
    hold (another is ``ChunkCorrupt``); ``max_bytes``: a larger record is ``ChunkOversize``.
    """
    if max_bytes is not None and len(blob) > max_bytes:
        raise ChunkOversize(f"{name}: {len(blob)} bytes, more than the {max_bytes} a record of this shape takes", name)
    if len(blob) < HEADER_BYTES:
        raise ChunkTruncated(f"{name}: {len(blob)} bytes, shorter than the {HEADER_BYTES}-byte header", name)
    magic, version, flags, meta_len, body_len, digest = _HEADER.unpack_from(blob)
    if magic != RECORD_MAGIC:
        raise ChunkCorrupt(f"{name}: bad magic {magic!r}", name)
    if version not in READ_VERSIONS:
        raise ChunkCorrupt(f"{name}: record version {version}, this build reads {READ_VERSIONS}", name)
    if version == 4 and flags & ~_KNOWN_FLAGS:
        raise ChunkCorrupt(f"{name}: unknown record flags {flags:#x}", name)
    if meta_len > META_MAX_BYTES:
        raise ChunkCorrupt(f"{name}: metadata of {meta_len} bytes, more than {META_MAX_BYTES}", name)
    want = HEADER_BYTES + meta_len + body_len
    if len(blob) < want:
        raise ChunkTruncated(f"{name}: {len(blob)} bytes, header says {want}", name)
    if len(blob) > want:
        raise ChunkCorrupt(f"{name}: {len(blob)} bytes, header says {want}", name)
    view = memoryview(blob)
    if view.itemsize != 1:
        view = view.cast("B")
    if auth is None and version >= 3 and not flags & FLAG_KEYED:  # the common unkeyed case, inline (hot path)
        if xxhash.xxh3_128_intdigest(view[HEADER_BYTES:]).to_bytes(16, "little") != digest:
            raise ChunkCorrupt(f"{name}: checksum mismatch", name)
    else:
        _authenticate(view, version, flags, digest, auth, name)
    meta_b = view[HEADER_BYTES : HEADER_BYTES + meta_len]
    body = view[HEADER_BYTES + meta_len :]
    rec_dtype, shape, n_tok, codec, block_size, profile = _read_meta(bytes(meta_b), key, layer, name)
    if dtype is not None and rec_dtype != dtype:
        raise ChunkCorrupt(f"{name}: KV dtype {_DTYPE_NAMES[rec_dtype]}, this engine's is "
                           f"{_DTYPE_NAMES.get(dtype, dtype)}", name)
    hashed = version == 4 and flags & FLAG_TOKEN_HASH
    tok_len = TOKEN_HASH_BYTES if hashed else 4 * n_tok
    if tok_len > len(body):
        raise ChunkCorrupt(f"{name}: body of {len(body)} bytes cannot hold the {tok_len}-byte token section", name)
    try:
        expect_tok = _token_bytes_fast(tokens)
    except (OverflowError, ValueError) as e:
        raise TokenMismatch(f"{name}: the request's token ids cannot be stored ids ({e})", name) from None
    if len(expect_tok) != 4 * n_tok:
        raise TokenMismatch(f"{name}: record holds {n_tok} tokens, the request's chunk {len(expect_tok) // 4}", name)
    stored_tok = body[:tok_len].tobytes()  # a memoryview compared with bytes goes item by item, far slower
    if stored_tok != (token_hash(expect_tok, auth) if hashed else expect_tok):
        raise TokenMismatch(f"{name}: stored token ids differ from the request's prefix", name)
    payload = body[tok_len:]
    off = HEADER_BYTES + meta_len + tok_len
    if codec == PROFILE_CODEC:
        e = ProfileEntry(payload.tobytes(), tuple(shape), profile)
        if not decode:
            return e
        try:
            return e.decode()
        except ChunkCorrupt as ex:
            raise ChunkCorrupt(f"{name}: {ex}", name) from None
    if codec is not None:
        return _zip_entry(blob, payload, off, shape, block_size, name, copy, decode)
    itemsize = _ITEMSIZE[rec_dtype]
    if len(payload) != itemsize * math.prod(shape):
        raise ChunkCorrupt(f"{name}: payload {len(payload)} bytes does not match {_DTYPE_NAMES[rec_dtype]}{shape}",
                           name)
    if len(payload) == 0:
        return torch.empty(shape, dtype=rec_dtype)
    if copy:
        return torch.frombuffer(bytearray(payload), dtype=rec_dtype).reshape(shape)
    return torch.frombuffer(blob, dtype=rec_dtype, count=len(payload) // itemsize, offset=off).reshape(shape)


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
