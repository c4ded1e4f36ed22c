"""Disk tier bounds and hygiene: LRU capacity (seeded from mtimes at open), temporary files swept, chunks missing
layers removed, a full disk (ENOSPC) evicts and retries or fails the write alone, per-entry read failures."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch

import kvtide.store.disk as disk
from kvtide.store import (
    ChunkOversize,
    DiskStore,
    EntryUnreadable,
    KeySpace,
    StoreFull,
    chunk_keys,
    record_bytes_bound,
)
from kvtide.store.factory import check_spec, open_tier

SP = KeySpace("m", 16)
TOKENS = list(range(9000, 9000 + 16 * 8))
KEYS = chunk_keys(TOKENS, SP)
SHAPE = (2, 16, 2, 8)


def toks(c: int) -> list[int]:
    return TOKENS[16 * c:16 * (c + 1)]


def kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).bfloat16()


def entry_size(tmp_path: Path) -> int:
    s = DiskStore(tmp_path / "probe")
    return s.put(KEYS[0], 0, toks(0), kv(0))


def names(s: DiskStore) -> set[str]:
    return {p.name[:-len(disk.SUFFIX)] for p in s.root.glob("*/*" + disk.SUFFIX)}


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(disk.TMP_PREFIX)]


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    n = entry_size(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=3 * n)
    for c in range(3):
        s.put(KEYS[c], 0, toks(c), kv(c))
    s.get(KEYS[0], 0, toks(0))  # chunk 0 used again: chunk 1 is now the least recent
    s.put(KEYS[3], 0, toks(3), kv(3))
    assert names(s) == {KEYS[c].entry_name(0) for c in (0, 2, 3)}
    assert s.stats.evictions == 1 and s.used_bytes == 3 * n <= s.capacity_bytes
    assert s.put(KEYS[4], 0, toks(4), torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)) == 0  # larger than it all
    assert s.stats.rejected == 1 and len(s) == 3


def test_lru_order_is_seeded_from_mtimes_at_open(tmp_path: Path) -> None:
    n = entry_size(tmp_path)
    a = DiskStore(tmp_path / "kv")
    for c in range(4):
        a.put(KEYS[c], 0, toks(c), kv(c))
    now = time.time()
    for age, c in ((400, 2), (300, 0), (200, 3), (100, 1)):  # oldest first: 2, 0, 3, 1
        os.utime(a.path(KEYS[c].entry_name(0)), (now - age, now - age))
    b = DiskStore(tmp_path / "kv", capacity_bytes=3 * n)  # over its bound at open: the oldest goes
    assert names(b) == {KEYS[c].entry_name(0) for c in (0, 3, 1)}
    b.put(KEYS[5], 0, toks(5), kv(5))
    assert names(b) == {KEYS[c].entry_name(0) for c in (3, 1, 5)}


def test_temporary_files_are_swept_at_open(tmp_path: Path) -> None:
    a = DiskStore(tmp_path / "kv")
    a.put(KEYS[0], 0, toks(0), kv(0))
    sub = a.path(KEYS[0].entry_name(0)).parent
    old, fresh = sub / ".tmp-killed", sub / ".tmp-writing"
    old.write_bytes(b"half a record")
    fresh.write_bytes(b"another process is writing this")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    b = DiskStore(tmp_path / "kv")
    assert not old.exists() and fresh.exists()  # younger than grace_s: maybe a live writer's
    assert b.stats.swept == 1 and torch.equal(b.get(KEYS[0], 0, toks(0)).view(torch.int16), kv(0).view(torch.int16))
    DiskStore(tmp_path / "kv", grace_s=0)
    assert not fresh.exists()


def _age(s: DiskStore) -> None:
    past = time.time() - 3600
    for p in s.root.glob("*/*" + disk.SUFFIX):
        os.utime(p, (past, past))


def test_chunks_missing_layers_are_removed(tmp_path: Path) -> None:
    a = DiskStore(tmp_path / "kv")
    layers = {0: (0, 1, 2), 1: (0, 2), 2: (0, 1), 3: (1, 2)}  # whole; a gap; a prefix; no layer 0
    for c, ls in layers.items():
        for i in ls:
            a.put(KEYS[c], i, toks(c), kv(10 * c + i))
    _age(a)
    b = DiskStore(tmp_path / "kv")  # layer count unknown: only gaps (and a missing layer 0) can be told
    assert names(b) == {KEYS[c].entry_name(i) for c in (0, 2) for i in layers[c]}
    assert b.stats.swept == 4
    assert b.prune_incomplete(3) == 2  # known: every chunk needs layers 0, 1, 2
    assert names(b) == {KEYS[0].entry_name(i) for i in range(3)}
    c = DiskStore(tmp_path / "kv", num_layers=4)
    assert names(c) == set() and c.used_bytes == 0 and len(c) == 0


def test_young_partial_chunks_are_left_to_their_writer(tmp_path: Path) -> None:
    a = DiskStore(tmp_path / "kv")
    a.put(KEYS[0], 1, toks(0), kv(0))
    assert DiskStore(tmp_path / "kv", num_layers=3).stats.swept == 0 and len(names(a)) == 1


class Quota:
    """A disk of ``limit`` bytes behind the store's file writes: a write past it writes what fits, then ENOSPC."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit, self.full = root, limit, 0

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def __call__(self, f, blob) -> None:  # noqa: ANN001
        room = self.limit - self.used()
        if len(blob) > room:
            f.write(blob[:max(0, room)])
            f.flush()
            self.full += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(blob)


def test_full_disk_removes_the_partial_file_evicts_and_retries(tmp_path: Path, monkeypatch) -> None:
    n = entry_size(tmp_path)
    s = DiskStore(tmp_path / "kv")  # no capacity set: the disk itself is the bound
    quota = Quota(s.root, 3 * n + n // 2)
    monkeypatch.setattr(disk, "_write_all", quota)
    for c in range(3):
        s.put(KEYS[c], 0, toks(c), kv(c))
    assert s.put(KEYS[3], 0, toks(3), kv(3)) == n  # full: the oldest entry went, the retry fit
    assert quota.full == 1 and s.stats.evictions == 1 and s.stats.put_failures == 0
    assert names(s) == {KEYS[c].entry_name(0) for c in (1, 2, 3)}
    assert not tmp_files(s.root)


def test_full_disk_with_nothing_to_evict_fails_the_write_alone(tmp_path: Path, monkeypatch) -> None:
    n = entry_size(tmp_path)
    s = DiskStore(tmp_path / "kv")
    monkeypatch.setattr(disk, "_write_all", Quota(s.root, n // 2))
    with pytest.raises(StoreFull):
        s.put(KEYS[0], 0, toks(0), kv(0))
    assert s.stats.put_failures == 1 and s.stats.puts == 0 and s.stats.bytes_written == 0
    assert s.stats.unavailable == 0  # the tier is up: reads go on
    assert not tmp_files(s.root) and names(s) == set()  # no partial record left behind


def test_per_entry_read_failures_stay_per_entry(tmp_path: Path) -> None:
    s = DiskStore(tmp_path / "kv")
    for c in range(4):
        s.put(KEYS[c], 0, toks(c), kv(c))
    p = s.path(KEYS[1].entry_name(0))
    p.unlink()
    p.mkdir()  # unreadable in its place
    s.path(KEYS[2].entry_name(0)).write_bytes(b"\0" * (1 << 20))  # larger than any record of the shape
    bound = record_bytes_bound(SHAPE, torch.bfloat16, 16)
    f = s.fetch([(KEYS[c], 0) for c in range(4)], max_bytes=bound)
    assert isinstance(f.blobs[0], bytes)
    assert isinstance(f.blobs[1], EntryUnreadable) and isinstance(f.blobs[2], ChunkOversize)
    assert isinstance(f.blobs[3], bytes)  # the neighbours of the bad entries are read
    st = s.stats
    assert st.read_errors == 1 and st.oversize == 1 and st.unavailable == 0


def test_disk_spec_capacity(tmp_path: Path) -> None:
    check_spec(f"disk:{tmp_path}/a?capacity=10G")
    t = open_tier(f"disk:{tmp_path}/a?capacity=512M", breaker_failures=0)
    assert isinstance(t, DiskStore) and t.capacity_bytes == 512 << 20
    assert open_tier(f"disk:{tmp_path}/b", breaker_failures=0).capacity_bytes is None
    for bad, why in ((f"disk:{tmp_path}?size=1G", "unknown option"), (f"disk:{tmp_path}?capacity=lots", "capacity"),
                     (f"disk:{tmp_path}?capacity=0", "positive"), ("disk:?capacity=1G", "needs a path")):
        with pytest.raises(ValueError, match=why):
            check_spec(bad)
    assert [disk.parse_size(x) for x in ("64K", "1.5G", "2t", "100", "8MiB")] == \
        [64 << 10, 3 << 29, 2 << 40, 100, 8 << 20]
