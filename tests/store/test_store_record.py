"""The versioned, checksummed (chunk, layer) record."""

from __future__ import annotations

import struct

import pytest
import torch

from kvtide.store.base import (
    HEADER_BYTES,
    ChunkCorrupt,
    ChunkTruncated,
    TokenMismatch,
    decode_record,
    encode_record,
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
    return encode_record(KEY, 2, TOKENS, torch.randn(2, 16, 1, 8).bfloat16())


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
    struct.pack_into("<H", b, 4, 2)
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
