"""Store records in the ZipFusion format (codec "zip1"): bit-exact, smaller, and refused when inconsistent."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash

from kvtide.cache import zip_format as zf
from kvtide.store import MemoryStore, PinnedMemoryStore
from kvtide.store.base import HEADER_BYTES, ChunkCorrupt, decode_record, encode_record
from kvtide.store.keys import KeySpace, chunk_keys
from kvtide.store.writer import StoreWriter
from kvtide.store.zip_entry import ZipEntry, encode_entries, from_tensor

SP = KeySpace("m", 16)
TOKENS = list(range(2000, 2016))
KEY = chunk_keys(TOKENS, SP)[0]
ALL = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def reseal(b: bytearray) -> bytes:
    """A record whose bytes were edited, with its checksum made right again (what a buggy writer would store)."""
    b[20:36] = xxhash.xxh3_128_intdigest(bytes(b[HEADER_BYTES:])).to_bytes(16, "little")
    return bytes(b)


def payload_at(rec: bytes) -> int:
    _, _, _, meta_len, _, _ = struct.unpack_from("<4sHHIQ16s", rec)
    return HEADER_BYTES + meta_len + 4 * len(TOKENS)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_bf16_pattern_round_trips(order: str) -> None:
    bits = ALL if order == "sorted" else ALL[torch.randperm(ALL.numel(), generator=torch.Generator().manual_seed(3))]
    kv = bits.view(torch.bfloat16).view(2, 16, 4, 512)
    e = from_tensor(kv)
    assert bool((e.desc == 0xFF).all()) if order == "shuffled" else bool((e.desc != 0xFF).all())
    rec = bytes(encode_record(KEY, 1, TOKENS, e))
    out = decode_record(rec, KEY, 1, TOKENS)
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), kv.view(torch.int16))
    lazy = decode_record(rec, KEY, 1, TOKENS, copy=False, decode=False)
    assert isinstance(lazy, ZipEntry) and lazy.shape == (2, 16, 4, 512)
    assert torch.equal(lazy.decode().view(torch.int16), kv.view(torch.int16))
    plain = len(encode_record(KEY, 1, TOKENS, kv))
    assert len(rec) < plain * 0.76 if order == "sorted" else len(rec) > plain  # raw blocks pay the descriptors


def test_real_like_kv_is_smaller_and_exact() -> None:
    kv = (torch.randn(2, 16, 2, 64, generator=torch.Generator().manual_seed(4)) * 0.3).bfloat16()
    kv[0, 0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 0.0, -0.0]).bfloat16()
    e = from_tensor(kv)
    rec = bytes(encode_record(KEY, 0, TOKENS, e))
    meta = json.loads(rec[HEADER_BYTES:payload_at(rec) - 64])
    assert meta["codec"] == "zip1" and meta["block_size"] == 512 and meta["dtype"] == "bfloat16"
    assert torch.equal(decode_record(rec, KEY, 0, TOKENS).view(torch.int16), kv.view(torch.int16))
    assert len(rec) < len(encode_record(KEY, 0, TOKENS, kv))
    assert e.payload_nbytes() == len(rec) - payload_at(rec)


def test_fixed_slots_hold_the_packed_blocks() -> None:
    x = (torch.randn(3, 2 * 16 * 2 * 64) * 2).bfloat16()
    x[1, :512] *= torch.logspace(-30, 30, 512).bfloat16()  # one raw block
    desc, slots = encode_entries(x, (2, 16, 2, 64))
    assert slots.shape == (3, 2 * x.shape[1])
    for g in range(3):
        ref = zf.encode_groups(x[g:g + 1].contiguous())
        assert torch.equal(desc[g], ref.desc[0])
        n = ref.data.numel()
        assert torch.equal(slots[g, :n], ref.data)
        e = ZipEntry(desc[g], slots[g], (2, 16, 2, 64))
        assert e.packed_nbytes() == n and torch.equal(e.decode().view(-1), x[g])
    assert int(desc[1, 0]) == 0xFF


def test_inconsistent_payloads_are_corrupt() -> None:
    kv = (torch.randn(2, 16, 2, 64, generator=torch.Generator().manual_seed(5))).bfloat16()
    rec = bytearray(encode_record(KEY, 0, TOKENS, from_tensor(kv)))
    p = payload_at(bytes(rec))
    bad = bytearray(rec)
    bad[p] = 0x90  # a v2 escape descriptor: not this codec
    with pytest.raises(ChunkCorrupt, match="descriptor"):
        decode_record(reseal(bad), KEY, 0, TOKENS)
    bad = bytearray(rec)
    bad[p] = 0xFF  # says raw: the payload is then 256 bytes short
    with pytest.raises(ChunkCorrupt, match="payload"):
        decode_record(reseal(bad), KEY, 0, TOKENS)
    bad = bytearray(rec)
    bad[-1] ^= 1  # unsealed damage: the checksum
    with pytest.raises(ChunkCorrupt, match="checksum"):
        decode_record(bytes(bad), KEY, 0, TOKENS)
    for old, new in ((b'"zip1"', b'"zip9"'), (b'"bfloat16"', b'"float16" ')):
        bad = bytearray(bytes(rec).replace(old, new))
        with pytest.raises(ChunkCorrupt, match="codec"):
            decode_record(reseal(bad), KEY, 0, TOKENS)


def test_encode_refuses_inconsistent_entries() -> None:
    e = from_tensor(torch.randn(2, 16, 2, 64).bfloat16())
    with pytest.raises(ValueError, match="descriptors say"):
        encode_record(KEY, 0, TOKENS, ZipEntry(e.desc, e.data[:100], e.shape))
    with pytest.raises(ValueError, match="does not hold"):
        encode_record(KEY, 0, TOKENS, ZipEntry(e.desc[:1], e.data, e.shape))
    with pytest.raises(TypeError, match="bfloat16"):
        encode_entries(torch.zeros(1, 512), (2, 16, 16))


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_tiers_store_and_fetch_zip_entries(tier: str) -> None:
    store = MemoryStore(1 << 20) if tier == "memory" else PinnedMemoryStore(1 << 20)
    kv = (torch.randn(2, 16, 2, 64) * 0.1).bfloat16()
    n = store.put(KEY, 4, TOKENS, from_tensor(kv))
    assert 0 < n < 2 * 16 * 2 * 64 * 2
    assert torch.equal(store.get(KEY, 4, TOKENS).view(torch.int16), kv.view(torch.int16))
    f = store.fetch([(KEY, 4)])
    lazy = store.open(f.blobs[0], KEY, 4, TOKENS, copy=False, decode=False).tensor
    assert isinstance(lazy, ZipEntry) and lazy.span.numel() == lazy.payload_nbytes()
    assert torch.equal(lazy.decode().view(torch.int16), kv.view(torch.int16))
    f.release()


def test_writer_counts_and_releases_zip_entries() -> None:
    store = MemoryStore(1 << 20)
    w = StoreWriter(store, max_bytes=1 << 20)
    kv = [(torch.randn(2, 16, 2, 64) * 0.1).bfloat16() for _ in range(3)]
    entries = [from_tensor(x) for x in kv]
    held = sum(e.held_nbytes for e in entries)
    assert w.admit(held)
    w.submit(KEY, TOKENS, entries)
    w.flush()
    assert w.queued_bytes == 0 and w.stats.entries == 3 and w.stats.failures == 0
    assert w.stats.bytes == sum(len(encode_record(KEY, i, TOKENS, e)) for i, e in enumerate(entries))
    for i, x in enumerate(kv):
        assert torch.equal(store.get(KEY, i, TOKENS).view(torch.int16), x.view(torch.int16))
    w.close()
