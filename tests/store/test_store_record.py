"""The versioned, checksummed (chunk, layer) record."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvtide.store.base import (
    HEADER_BYTES,
    PAYLOAD_ALIGN,
    RECORD_VERSION,
    ChunkCorrupt,
    ChunkTruncated,
    TokenMismatch,
    decode_record,
    encode_record,
    token_array,
)
from kvtide.store.keys import KeySpace, chunk_keys

SP = KeySpace("m", 16)
TOKENS = list(range(1000, 1016))
KEY = chunk_keys(TOKENS, SP)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_round_trip_bit_exact(dtype: torch.dtype) -> None:
    kv = (torch.randn(2, 16, 3, 64) * 100).to(dtype)
    blob = encode_record(KEY, 5, TOKENS, kv)
    out = decode_record(blob, KEY, 5, TOKENS)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)) if dtype != torch.uint8 else torch.equal(out, kv)


def test_special_bf16_values_survive() -> None:
    bits = torch.arange(0, 2**16, 97, dtype=torch.int32).to(torch.int16)
    kv = bits[: 2 * 16 * 2 * 8].reshape(2, 16, 2, 8).view(torch.bfloat16)  # includes NaN/inf/denormal patterns
    out = decode_record(encode_record(KEY, 0, TOKENS, kv), KEY, 0, TOKENS)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


def blob() -> bytes:
    return bytes(encode_record(KEY, 2, TOKENS, torch.randn(2, 16, 1, 8).bfloat16()))


def test_flipped_payload_bit_is_corrupt() -> None:
    b = bytearray(blob())
    b[-3] ^= 0x10
    with pytest.raises(ChunkCorrupt):
        decode_record(bytes(b), KEY, 2, TOKENS)


@pytest.mark.parametrize("cut", [0, 10, HEADER_BYTES, HEADER_BYTES + 5, -1])
def test_truncated(cut: int) -> None:
    with pytest.raises(ChunkTruncated):
        decode_record(blob()[:cut], KEY, 2, TOKENS)


def test_extra_bytes_bad_magic_and_future_version() -> None:
    with pytest.raises(ChunkCorrupt):
        decode_record(blob() + b"x", KEY, 2, TOKENS)
    with pytest.raises(ChunkCorrupt):
        decode_record(b"XXXX" + blob()[4:], KEY, 2, TOKENS)
    b = bytearray(blob())
    struct.pack_into("<H", b, 4, 99)
    with pytest.raises(ChunkCorrupt, match="version"):
        decode_record(bytes(b), KEY, 2, TOKENS)


def test_token_mismatch_and_wrong_entry() -> None:
    with pytest.raises(TokenMismatch):
        decode_record(blob(), KEY, 2, TOKENS[:-1] + [7])
    with pytest.raises(ChunkCorrupt):
        decode_record(blob(), KEY, 3, TOKENS)  # another layer's entry under this name
    other = chunk_keys(list(range(16)), SP)[0]
    with pytest.raises(ChunkCorrupt):
        decode_record(blob(), other, 2, TOKENS)


def test_encode_validates_shape() -> None:
    with pytest.raises(ValueError):
        encode_record(KEY, 0, TOKENS, torch.zeros(2, 8, 1, 4))
    with pytest.raises(ValueError):
        encode_record(KEY, 0, TOKENS, torch.zeros(3, 16, 1, 4))
    with pytest.raises(ValueError):
        encode_record(KEY, 0, TOKENS, torch.zeros(2, 16, 1, 4, dtype=torch.float64))


def _v1_record(kv: torch.Tensor, layer: int = 2) -> bytes:
    """A record as version 1 wrote it (blake2b-128 checksum, no padding)."""
    import hashlib
    import json

    from kvtide.store.keys import token_bytes

    meta = json.dumps({"key": KEY.hex, "layer": layer, "dtype": "bfloat16", "shape": list(kv.shape),
                       "num_tokens": 16, "byteorder": "little"}, separators=(",", ":")).encode()
    body = token_bytes(TOKENS) + kv.contiguous().view(torch.uint8).numpy().tobytes()
    h = hashlib.blake2b(digest_size=16)
    h.update(meta)
    h.update(body)
    return struct.pack("<4sHHIQ16s", b"KVTR", 1, 0, len(meta), len(body), h.digest()) + meta + body


def _v2_record(kv: torch.Tensor) -> bytes:
    """A record as version 2 wrote it (CRC-32 then 12 zero bytes), from a v3 one: same layout, other digest."""
    import zlib

    rec = bytearray(encode_record(KEY, 2, TOKENS, kv))
    struct.pack_into("<H", rec, 4, 2)
    crc = zlib.crc32(bytes(rec[HEADER_BYTES:])) & 0xFFFFFFFF
    rec[20:36] = crc.to_bytes(4, "little") + bytes(12)
    return bytes(rec)


def test_written_records_are_xxh3_and_payload_aligned() -> None:
    import xxhash

    kv = torch.randn(2, 16, 3, 64).bfloat16()
    rec = encode_record(KEY, 2, TOKENS, kv)
    _, version, _, meta_len, body_len, digest = struct.unpack_from("<4sHHIQ16s", rec)
    assert version == RECORD_VERSION == 4  # v4 without a secret: flags 0 and v3's XXH3 digest
    assert digest == xxhash.xxh3_128_intdigest(rec[HEADER_BYTES:]).to_bytes(16, "little")
    assert (HEADER_BYTES + meta_len + 4 * 16) % PAYLOAD_ALIGN == 0  # padded meta: aligned payload


@pytest.mark.parametrize("version", [1, 2])
def test_older_record_versions_still_read_and_checked(version: int) -> None:
    kv = torch.randn(2, 16, 1, 8).bfloat16()
    old = {1: _v1_record, 2: _v2_record}[version](kv)
    assert torch.equal(decode_record(old, KEY, 2, TOKENS).view(torch.int16), kv.view(torch.int16))
    b = bytearray(old)
    b[-1] ^= 1
    with pytest.raises(ChunkCorrupt, match="checksum"):
        decode_record(bytes(b), KEY, 2, TOKENS)


@pytest.mark.parametrize("where", ["meta", "tokens", "payload"])
def test_checksum_catches_a_flip_anywhere(where: str) -> None:
    rec = bytearray(blob())
    meta_len = struct.unpack_from("<I", rec, 8)[0]
    pos = {"meta": HEADER_BYTES + 3, "tokens": HEADER_BYTES + meta_len + 5, "payload": len(rec) - 9}[where]
    rec[pos] ^= 0x01
    with pytest.raises(ChunkCorrupt):  # checksum first: a flipped token id is damage, not a mismatch
        decode_record(bytes(rec), KEY, 2, TOKENS)


def test_zero_copy_decode_is_a_view_of_the_record() -> None:
    kv = torch.randn(2, 16, 3, 64).bfloat16()
    rec = encode_record(KEY, 1, TOKENS, kv)
    view = decode_record(rec, KEY, 1, TOKENS, copy=False)
    assert torch.equal(view.view(torch.int16), kv.view(torch.int16))
    start = view.untyped_storage().data_ptr()
    base = np.frombuffer(rec, np.uint8).ctypes.data
    assert base <= start < base + len(rec)  # no copy was made
    owned = decode_record(rec, KEY, 1, TOKENS)
    assert owned.untyped_storage().data_ptr() != start


def test_record_is_read_only_and_encodes_a_strided_slice() -> None:
    """The writer passes slices of a larger per-layer read; the stored record must not be writable after."""
    big = torch.randn(2, 48, 1, 8).bfloat16()
    kv = big[:, 16:32]
    rec = encode_record(KEY, 2, TOKENS, kv)
    assert rec.readonly
    with pytest.raises(TypeError):
        rec[0] = 1
    assert torch.equal(decode_record(rec, KEY, 2, TOKENS).view(torch.int16), kv.contiguous().view(torch.int16))


def test_token_array_ids_check_like_a_list() -> None:
    """The loader's converted ids (``token_array``, sliced per entry) pass and fail exactly where a list does."""
    ids = token_array(TOKENS + [5, 6, 7])
    assert list(ids) == TOKENS + [5, 6, 7]
    kv = torch.randn(2, 16, 1, 8).bfloat16()
    rec = encode_record(KEY, 2, TOKENS, kv)
    assert torch.equal(decode_record(rec, KEY, 2, ids[:16]).view(torch.int16), kv.view(torch.int16))
    with pytest.raises(TokenMismatch):
        decode_record(rec, KEY, 2, token_array(TOKENS[:-1] + [7]))
    with pytest.raises(TokenMismatch):
        decode_record(rec, KEY, 2, ids[1:17])  # shifted by one
    bad = TOKENS[:-1] + [-1]
    assert token_array(bad) is bad  # ids that no record can hold stay a list, rejected by the general check
    with pytest.raises(TokenMismatch, match="cannot be stored"):
        decode_record(rec, KEY, 2, token_array(bad))


def _record_with_meta(meta: bytes, kv: torch.Tensor) -> bytes:
    """A v3 record with this metadata and a valid checksum (what a buggy or hostile writer could produce)."""
    import xxhash

    from kvtide.store.keys import token_bytes

    body = token_bytes(TOKENS) + kv.contiguous().view(torch.uint8).numpy().tobytes()
    h = xxhash.xxh3_128()
    h.update(meta)
    h.update(body)
    return struct.pack("<4sHHIQ16s", b"KVTR", 3, 0, len(meta), len(body), h.intdigest().to_bytes(16, "little")) \
        + meta + body


def test_metadata_parsed_once_still_checks_key_and_layer() -> None:
    """After the first entry of a shape its metadata tail is cached: later entries must still name the caller's
    key and layer, and metadata that names the key twice (JSON keeps the last) must take the full parse."""
    kv = torch.randn(2, 16, 1, 8).bfloat16()
    for layer in range(3):  # the same tail for every layer: parsed once, hit twice
        assert decode_record(encode_record(KEY, layer, TOKENS, kv), KEY, layer, TOKENS).shape == kv.shape
    rec = encode_record(KEY, 1, TOKENS, kv)
    with pytest.raises(ChunkCorrupt, match="entry is for"):
        decode_record(rec, KEY, 2, TOKENS)
    other = chunk_keys(list(range(16)), SP)[0]
    with pytest.raises(ChunkCorrupt, match="entry is for"):
        decode_record(rec, other, 1, TOKENS)
    tail = b'"dtype":"bfloat16","shape":[2,16,1,8],"num_tokens":16,"byteorder":"little"'
    twice = b'{"key":"%s","layer":1,%s,"key":"%s"}' % (KEY.hex.encode(), tail, other.hex.encode())
    with pytest.raises(ChunkCorrupt, match="entry is for"):
        decode_record(_record_with_meta(twice, kv), KEY, 1, TOKENS)
    escaped = b'{"key":"%s","layer":1,%s,"\\u006bey":"%s"}' % (KEY.hex.encode(), tail, other.hex.encode())
    for _ in range(2):  # not cached after the first failure either
        with pytest.raises(ChunkCorrupt, match="entry is for"):
            decode_record(_record_with_meta(escaped, kv), KEY, 1, TOKENS)
    wrong_shape = b'{"key":"%s","layer":1,%s}' % (KEY.hex.encode(), tail.replace(b"[2,16,1,8]", b"[2,16,1,4]"))
    with pytest.raises(ChunkCorrupt, match="payload"):
        decode_record(_record_with_meta(wrong_shape, kv), KEY, 1, TOKENS)
