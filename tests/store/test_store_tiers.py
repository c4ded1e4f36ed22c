"""Every tier: round trip, and every failure is a specific, counted StoreError (never garbage)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from kvtide.store import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkTruncated,
    DiskStore,
    EntryUnreadable,
    KeySpace,
    KVStore,
    MemoryStore,
    PinnedMemoryStore,
    StoreUnavailable,
    TokenMismatch,
    chunk_keys,
)

SP = KeySpace("m", 16)
TOKENS = list(range(5000, 5064))  # 4 chunks
KEYS = chunk_keys(TOKENS, SP)
L = 3


def kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 3, 64, generator=g).bfloat16()


def toks(c: int) -> list[int]:
    return TOKENS[16 * c : 16 * (c + 1)]


Poke = Callable[[str, bytes], None]


@pytest.fixture(params=["memory", "pinned", "disk", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[KVStore, Poke, Callable[[str], bytes]]]:
    if request.param in ("memory", "pinned"):
        s = MemoryStore(1 << 24) if request.param == "memory" else PinnedMemoryStore(1 << 24, slab_bytes=1 << 20)
        yield s, s._poke, s._read
    elif request.param == "disk":
        s = DiskStore(tmp_path / "kv")
        yield s, lambda n, b: s.path(n).write_bytes(b), s._read
    else:
        from kvtide.store.redis_store import RedisStore

        srv = request.getfixturevalue("redis_server")
        s = RedisStore(port=srv.port, prefix=f"t{os.getpid()}-{request.node.name}:")
        yield s, lambda n, b: s.client.set(s._k(n), b), s._read
        s.client.flushdb()
        s.close()


def test_round_trip_every_layer(tier) -> None:
    s, _, _ = tier
    for c, k in enumerate(KEYS):
        for layer in range(L):
            s.put(k, layer, toks(c), kv(10 * c + layer))
    for c, k in enumerate(KEYS):
        for layer in range(L):
            assert torch.equal(s.get(k, layer, toks(c)), kv(10 * c + layer))
    got = s.get_layers(KEYS[2], range(1, L), toks(2))  # layers [i, L) of one chunk
    assert set(got) == {1, 2} and torch.equal(got[2], kv(22))
    st = s.stats.snapshot()
    assert st["puts"] == 4 * L and st["hits"] == 4 * L + 2 and st["bytes_read"] > 0
    assert s.contains(KEYS[0], 0) and not s.contains(KEYS[0], L)


def test_missing_is_counted(tier) -> None:
    s, _, _ = tier
    with pytest.raises(ChunkMissing):
        s.get(KEYS[0], 0, toks(0))
    s.put(KEYS[0], 0, toks(0), kv(1))
    got = s.get_layers(KEYS[0], [0, 1], toks(0))
    assert isinstance(got[1], ChunkMissing) and torch.equal(got[0], kv(1))
    assert s.stats.misses == 2 and s.stats.fallbacks == 2


def test_corrupt_truncated_and_token_mismatch_are_detected_and_counted(tier) -> None:
    s, poke, read = tier
    for layer in range(3):
        s.put(KEYS[1], layer, toks(1), kv(layer))
    good = read(KEYS[1].entry_name(0))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    poke(KEYS[1].entry_name(0), bytes(bad))
    poke(KEYS[1].entry_name(1), good[: len(good) - 100])
    with pytest.raises(ChunkCorrupt) as e:
        s.get(KEYS[1], 0, toks(1))
    assert not isinstance(e.value, ChunkTruncated)
    with pytest.raises(ChunkTruncated):
        s.get(KEYS[1], 1, toks(1))
    with pytest.raises(TokenMismatch):
        s.get(KEYS[1], 2, toks(2))  # right key, wrong tokens: what a hash collision would look like
    st = s.stats.snapshot()
    assert (st["corrupt"], st["truncated"], st["token_mismatch"]) == (1, 1, 1)
    # bad entries were dropped, so the next look-up is a clean miss and a rewrite heals it
    with pytest.raises(ChunkMissing):
        s.get(KEYS[1], 0, toks(1))
    s.put(KEYS[1], 0, toks(1), kv(0))
    assert torch.equal(s.get(KEYS[1], 0, toks(1)), kv(0))


@pytest.mark.parametrize("make", [MemoryStore, lambda cap: PinnedMemoryStore(cap, slab_bytes=1 << 16)],
                         ids=["memory", "pinned"])
def test_memory_lru_eviction_by_bytes(make) -> None:
    one = MemoryStore(1 << 30)
    size = one.put(KEYS[0], 0, toks(0), kv(0))
    s = make(3 * size + 10)
    for c in range(3):
        s.put(KEYS[c], 0, toks(c), kv(c))
    s.get(KEYS[0], 0, toks(0))  # refresh chunk 0: chunk 1 is now least recently used
    s.put(KEYS[3], 0, toks(3), kv(3))
    assert s.stats.evictions == 1 and s.used_bytes <= s.capacity_bytes and len(s) == 3
    assert not s.contains(KEYS[1], 0) and s.contains(KEYS[0], 0) and s.contains(KEYS[3], 0)
    tiny = make(100)
    assert tiny.put(KEYS[0], 0, toks(0), kv(0)) == 0 and tiny.stats.rejected == 1 and len(tiny) == 0
    with pytest.raises(ValueError):
        make(0)


def test_disk_persists_across_instances_and_leaves_no_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    a = DiskStore(root, fsync=True)
    for layer in range(L):
        a.put(KEYS[0], layer, toks(0), kv(layer))
    a.put(KEYS[0], 0, toks(0), kv(7))  # overwrite is atomic replace
    b = DiskStore(root)
    assert torch.equal(b.get(KEYS[0], 0, toks(0)), kv(7))
    assert torch.equal(b.get(KEYS[0], 2, toks(0)), kv(2))
    assert not [p for p in root.rglob("*") if p.name.startswith(".tmp-")]
    assert b.total_bytes() > 0


def test_disk_unreadable_root_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StoreUnavailable):
        DiskStore(blocker / "kv")
    s = DiskStore(tmp_path / "kv")
    s.put(KEYS[0], 0, toks(0), kv(0))
    target = s.path(KEYS[0].entry_name(0))
    target.unlink()
    target.mkdir()  # reading a directory: this entry's own I/O error, not a miss, and not the tier's
    with pytest.raises(EntryUnreadable):
        s.get(KEYS[0], 0, toks(0))
    assert s.stats.read_errors == 1 and s.stats.unavailable == 0
    import shutil

    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_bytes(b"x")  # the store directory itself gone: the tier is unavailable
    with pytest.raises(StoreUnavailable):
        s.get(KEYS[0], 0, toks(0))
    assert s.stats.unavailable == 1


def test_redis_dead_server_and_wrong_port_are_unavailable(fresh_redis_server) -> None:
    from kvtide.store.redis_store import RedisStore

    s = RedisStore(port=fresh_redis_server.port, socket_timeout=0.5)
    s.put(KEYS[0], 0, toks(0), kv(0))
    assert torch.equal(s.get(KEYS[0], 0, toks(0)), kv(0))
    fresh_redis_server.proc.kill()
    fresh_redis_server.proc.wait()
    with pytest.raises(StoreUnavailable):
        s.get(KEYS[0], 0, toks(0))
    with pytest.raises(StoreUnavailable):
        s.put(KEYS[0], 1, toks(0), kv(1))
    got = s.get_layers(KEYS[0], [0, 1], toks(0))
    assert all(isinstance(v, StoreUnavailable) for v in got.values())
    assert not s.contains(KEYS[0], 0)
    assert s.stats.unavailable == 1 + 1 + 2 + 1 and s.stats.put_failures == 1
    assert not s.ping()
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nobody = RedisStore(port=port, socket_timeout=0.5)
    with pytest.raises(StoreUnavailable):
        nobody.get(KEYS[0], 0, toks(0))


def test_redis_ttl_and_mget(redis_server) -> None:
    from kvtide.store.redis_store import RedisStore

    s = RedisStore(port=redis_server.port, prefix="ttl:", ttl_seconds=60)
    s.put(KEYS[0], 0, toks(0), kv(0))
    assert 0 < s.client.ttl(s._k(KEYS[0].entry_name(0))) <= 60
    with pytest.raises(ValueError):
        RedisStore(port=redis_server.port, ttl_seconds=0)
    s.client.flushdb()


def test_fetch_then_open_in_one_round_trip(tier) -> None:
    """Bulk load path: raw bytes of many entries at once, then verify each (zero-copy or not), all counted."""
    s, poke, read = tier
    for c in range(3):
        for layer in range(L):
            s.put(KEYS[c], layer, toks(c), kv(10 * c + layer))
    bad = bytearray(read(KEYS[1].entry_name(2)))
    bad[-5] ^= 0x08
    poke(KEYS[1].entry_name(2), bytes(bad))
    items = [(KEYS[c], 2) for c in range(4)]  # chunk 3 was never written
    f = s.fetch(items)
    assert len(f.blobs) == 4 and isinstance(f.blobs[3], ChunkMissing)
    assert f.nbytes == sum(len(b) for b in f.blobs[:3])
    assert f.wait() == 0.0  # no link in front: the bytes are here
    got = s.open(f.blobs[0], KEYS[0], 2, toks(0), copy=False)
    assert torch.equal(got.tensor, kv(2)) and got.nbytes == len(f.blobs[0])
    with pytest.raises(ChunkCorrupt):
        s.open(f.blobs[1], KEYS[1], 2, toks(1))
    with pytest.raises(TokenMismatch):
        s.open(f.blobs[2], KEYS[2], 2, toks(1))
    st = s.stats.snapshot()
    assert (st["hits"], st["misses"], st["corrupt"], st["token_mismatch"]) == (1, 1, 1, 1)


def test_fetch_from_a_dead_redis_is_unavailable_per_entry(fresh_redis_server) -> None:
    from kvtide.store.redis_store import RedisStore

    s = RedisStore(port=fresh_redis_server.port, socket_timeout=0.5)
    s.put(KEYS[0], 0, toks(0), kv(0))
    fresh_redis_server.proc.kill()
    fresh_redis_server.proc.wait()
    f = s.fetch([(KEYS[0], 0), (KEYS[1], 0)])
    assert all(isinstance(b, StoreUnavailable) for b in f.blobs) and f.nbytes == 0
    assert s.stats.unavailable == 2
