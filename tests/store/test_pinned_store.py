"""PinnedMemoryStore: slab allocator, LRU bound, and leases that keep fetched bytes valid until released.

On the CPU the slabs are ordinary memory (``pinned`` False): everything but the DMA itself runs here; the device
path is covered by tests/restore/test_cuda_paths.py on a GPU.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from kvtide.store import ChunkCorrupt, KeySpace, MemoryStore, PinnedMemoryStore, chunk_keys
from kvtide.store.pinned import SlabArena

SP = KeySpace("p", 16)
TOKENS = list(range(7000, 7000 + 16 * 12))
KEYS = chunk_keys(TOKENS, SP)


def kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 2, 32, generator=g).bfloat16()


def toks(c: int) -> list[int]:
    return TOKENS[16 * c:16 * (c + 1)]


RECORD = MemoryStore(1 << 20).put(KEYS[0], 0, toks(0), kv(0))  # bytes of one record of this shape
SPAN = -(-RECORD // 64) * 64  # what it takes in a slab


class FakeEvent:
    """Stands in for a torch.cuda.Event: done when the test says so."""

    def __init__(self) -> None:
        self.done = False
        self.synced = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


def test_records_are_the_same_bytes_as_the_plain_memory_tier() -> None:
    plain, pinned = MemoryStore(1 << 20), PinnedMemoryStore(1 << 20, slab_bytes=1 << 16)
    for c in range(3):
        for layer in range(2):
            plain.put(KEYS[c], layer, toks(c), kv(c * 2 + layer))
            pinned.put(KEYS[c], layer, toks(c), kv(c * 2 + layer))
    for c in range(3):
        for layer in range(2):
            name = KEYS[c].entry_name(layer)
            assert pinned._read(name) == bytes(plain._read(name))
    assert pinned.used_bytes == plain.used_bytes and len(pinned) == 6 and pinned.pinned == torch.cuda.is_available()


def test_arena_matches_a_reference_model_under_random_alloc_and_free() -> None:
    """Extents never overlap, stay 64-byte aligned and inside their slab; freeing everything coalesces back."""
    rng = random.Random(0)
    a = SlabArena(4 << 10, slab_bytes=1 << 10)
    live = []
    for _ in range(2000):
        if live and (rng.random() < 0.45 or len(live) > 40):
            a.free(live.pop(rng.randrange(len(live))))
            continue
        rec = a.alloc(rng.randint(1, 300))
        if rec is None:
            continue
        assert rec.off % 64 == 0 and rec.off + rec.span <= a.slab_bytes and rec.span >= rec.size
        for other in live:
            if other.slab == rec.slab:
                assert rec.off + rec.span <= other.off or other.off + other.span <= rec.off
        live.append(rec)
    for rec in live:
        a.free(rec)
    assert len(a.slabs) <= 4 and all(f == [(0, a.slab_bytes)] for f in a._free)
    assert a.alloc(a.slab_bytes + 1) is None


def test_slab_limits_and_bad_config() -> None:
    """The LRU byte bound and whole-store rejection are the memory tier's test (test_store_tiers.py, both tiers)."""
    small_slabs = PinnedMemoryStore(1 << 20, slab_bytes=RECORD // 2)  # a record fits no slab
    assert small_slabs.put(KEYS[0], 0, toks(0), kv(0)) == 0 and small_slabs.stats.rejected == 1
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="capacity_bytes"):
            PinnedMemoryStore(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slab_bytes"):
        PinnedMemoryStore(1 << 20, slab_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            PinnedMemoryStore(1 << 20, pin=True)


def test_fragmentation_evicts_more_until_a_record_fits() -> None:
    """Slabs of two records each, one record deleted from each: the free bytes would hold a record twice as
    large, but no slab has that much in one piece, so the write evicts further until one has."""
    s = PinnedMemoryStore(4 * SPAN, slab_bytes=2 * SPAN)
    for c in range(4):
        s.put(KEYS[c], 0, toks(c), kv(c))
    assert len(s.arena.slabs) == 2
    s.delete(KEYS[0], 0)
    s.delete(KEYS[3], 0)
    big = torch.randn(2, 16, 4, 32).bfloat16()  # about twice a record: needs a whole slab
    assert s.put(KEYS[5], 0, toks(5), big) > 0
    assert torch.equal(s.get(KEYS[5], 0, toks(5)), big)
    assert s.stats.evictions >= 1 and s.used_bytes <= s.capacity_bytes


def test_a_leased_record_keeps_its_bytes_until_released() -> None:
    """Evicted or overwritten while a fetch holds it: the fetched view still holds the old record until release,
    its slot is not reused before (nor before the event, when one is given), and unleased records go first."""
    s = PinnedMemoryStore(3 * SPAN, slab_bytes=3 * SPAN)  # one slab of three slots
    s.put(KEYS[0], 0, toks(0), kv(0))
    s.put(KEYS[1], 0, toks(1), kv(1))
    f = s.fetch([(KEYS[0], 0), (KEYS[1], 0), (KEYS[9], 0)])
    before = [bytes(b) for b in f.blobs[:2]]
    assert s.leased == 2
    s.put(KEYS[2], 0, toks(2), kv(2))  # the third slot
    s.put(KEYS[3], 0, toks(3), kv(3))  # byte bound: evicts chunk 0 (leased), then chunk 2 for a free slot
    assert not s.contains(KEYS[0], 0) and not s.contains(KEYS[2], 0) and s.contains(KEYS[1], 0)
    s.put(KEYS[1], 0, toks(1), kv(11))  # overwrite of a leased record: chunk 3 (unleased) makes the room
    assert torch.equal(s.get(KEYS[1], 0, toks(1)), kv(11)) and not s.contains(KEYS[3], 0)
    assert [bytes(b) for b in f.blobs[:2]] == before  # both leased slots untouched
    assert torch.equal(s.open(f.blobs[0], KEYS[0], 0, toks(0), copy=False).tensor, kv(0))
    ev = FakeEvent()
    f.release(after=ev)
    f.release()  # idempotent: the first release decides
    assert s.leased == 2  # the device copy has not finished
    assert [bytes(b) for b in f.blobs[:2]] == before
    ev.done = True
    assert s.leased == 0
    for c in (4, 5):
        s.put(KEYS[c], 0, toks(c), kv(c))
    assert len(s) == 3 and all(s.contains(KEYS[c], 0) for c in (1, 4, 5))
    assert torch.equal(s.get(KEYS[5], 0, toks(5)), kv(5)) and torch.equal(s.get(KEYS[1], 0, toks(1)), kv(11))


def test_a_write_with_every_slot_leased_is_rejected_not_forced() -> None:
    s = PinnedMemoryStore(SPAN, slab_bytes=SPAN)  # one slot
    s.put(KEYS[0], 0, toks(0), kv(0))
    f = s.fetch([(KEYS[0], 0)])
    assert s.put(KEYS[1], 0, toks(1), kv(1)) == 0 and s.stats.rejected == 1
    assert torch.equal(s.open(f.blobs[0], KEYS[0], 0, toks(0)).tensor, kv(0))
    f.release()
    assert s.put(KEYS[1], 0, toks(1), kv(1)) > 0 and torch.equal(s.get(KEYS[1], 0, toks(1)), kv(1))


def test_a_write_waits_for_the_oldest_device_copy_when_only_leased_records_are_left() -> None:
    s = PinnedMemoryStore(SPAN, slab_bytes=SPAN)  # one slot
    s.put(KEYS[0], 0, toks(0), kv(0))
    f = s.fetch([(KEYS[0], 0)])
    ev = FakeEvent()
    f.release(after=ev)
    assert s.put(KEYS[1], 0, toks(1), kv(1)) > 0  # the only slot is leased: the write waits for that copy
    assert ev.synced == 1 and s.leased == 0 and torch.equal(s.get(KEYS[1], 0, toks(1)), kv(1))


def test_a_fetch_dropped_without_release_gives_its_records_back() -> None:
    s = PinnedMemoryStore(1 << 20, slab_bytes=1 << 16)
    s.put(KEYS[0], 0, toks(0), kv(0))
    f = s.fetch([(KEYS[0], 0)])
    assert s.leased == 1
    del f
    gc.collect()
    assert s.leased == 0


def test_corrupt_entry_fetched_and_dropped_while_leased() -> None:
    s = PinnedMemoryStore(1 << 20, slab_bytes=1 << 16)
    s.put(KEYS[0], 0, toks(0), kv(0))
    bad = bytearray(s._read(KEYS[0].entry_name(0)))
    bad[-3] ^= 0x10
    s._poke(KEYS[0].entry_name(0), bytes(bad))
    f = s.fetch([(KEYS[0], 0)])
    with pytest.raises(ChunkCorrupt):
        s.open(f.blobs[0], KEYS[0], 0, toks(0))  # dropped from the index (drop_bad) while leased
    assert not s.contains(KEYS[0], 0) and s.stats.corrupt == 1
    f.release()
    assert s.leased == 0 and s.used_bytes == 0 and s.arena.free_bytes() == s.arena.reserved_bytes


def test_copy_holds_the_same_entries_in_its_own_slabs() -> None:
    s = PinnedMemoryStore(1 << 20, slab_bytes=1 << 16)
    for c in range(3):
        s.put(KEYS[c], 0, toks(c), kv(c))
    t = s.copy()
    s.delete(KEYS[0], 0)
    assert torch.equal(t.get(KEYS[0], 0, toks(0)), kv(0)) and len(t) == 3 and t.used_bytes == 3 * RECORD
