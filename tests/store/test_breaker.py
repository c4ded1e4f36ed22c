"""Circuit breaker per tier: N consecutive tier failures skip the tier (no I/O) for a back-off, then one probe;
per-entry errors never count; opens, probes and skips counted; tier down / up logged."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from kvtide.log import reset_limits
from kvtide.store import ChunkCorrupt, ChunkMissing, KeySpace, MemoryStore, StoreError, StoreUnavailable, chunk_keys
from kvtide.store.base import EntryUnreadable
from kvtide.store.breaker import CircuitBreaker, TierSkipped, breaker_of, guarded, present
from kvtide.store.bandwidth import BandwidthLimitedStore, TokenBucket

KEYS = chunk_keys(list(range(32)), KeySpace("m", 16))
TOK = list(range(16))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Flaky(MemoryStore):
    """A memory tier that can be 'down' (every raw operation raises StoreUnavailable); counts raw calls."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.down = False
        self.unreadable: set[str] = set()
        self.calls = 0

    def _op(self) -> None:
        self.calls += 1
        if self.down:
            raise StoreUnavailable("flaky tier is down")

    def _write(self, name, blob):
        self._op()
        return super()._write(name, blob)

    def _read(self, name, max_bytes=None):
        self._op()
        if name in self.unreadable:
            raise EntryUnreadable(f"{name}: bad sector", name)
        return super()._read(name, max_bytes)

    def _read_many(self, names, max_bytes=None):
        # the base class's loop over _read: nested guarded calls must count as one operation
        from kvtide.store.base import KVStore

        return KVStore._read_many(self, names, max_bytes)

    def _exists(self, name):
        self._op()
        return super()._exists(name)


def kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 16, 1, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def tier():
    reset_limits()
    clock = Clock()
    s = guarded(Flaky)(1 << 20, breaker=CircuitBreaker("flaky", failures=3, backoff_s=5.0, clock=clock))
    return s, clock


def test_opens_after_n_consecutive_failures_then_skips_without_io(tier, caplog) -> None:
    s, _ = tier
    s.put(KEYS[0], 0, TOK, kv())
    s.down = True
    caplog.set_level(logging.WARNING, "kvtide")
    for i in range(3):
        assert s.breaker.state == "closed"
        with pytest.raises(StoreUnavailable) as e:
            s.get(KEYS[0], 0, TOK)
        assert not isinstance(e.value, TierSkipped)
    assert s.breaker.state == "open"
    calls = s.calls
    with pytest.raises(TierSkipped):
        s.get(KEYS[0], 0, TOK)
    with pytest.raises(TierSkipped):
        s.put(KEYS[1], 0, TOK, kv())
    assert not s.contains(KEYS[0], 0)
    f = s.fetch([(KEYS[0], 0), (KEYS[1], 0)])
    assert all(isinstance(b, TierSkipped) for b in f.blobs)
    assert s.calls == calls  # skipped: no operation reached the tier
    st = s.breaker.stats.snapshot()
    assert st["opens"] == 1 and st["failures"] == 3 and st["skipped"] == 4
    assert s.stats.put_failures == 1  # a skipped write is a failed write, never a written one
    down = [r for r in caplog.records if "store tier flaky is down" in r.getMessage()]
    assert len(down) == 1


def test_back_off_then_one_probe_closes_or_reopens(tier, caplog) -> None:
    s, clock = tier
    s.put(KEYS[0], 0, TOK, kv())
    s.down = True
    for _ in range(3):
        with pytest.raises(StoreUnavailable):
            s.get(KEYS[0], 0, TOK)
    clock.t += 5.1
    assert s.breaker.state == "half-open"
    calls = s.calls
    with pytest.raises(StoreUnavailable) as e:  # the probe fails: open for another back-off
        s.get(KEYS[0], 0, TOK)
    assert not isinstance(e.value, TierSkipped) and s.calls == calls + 1
    assert s.breaker.state == "open" and s.breaker.stats.opens == 2
    with pytest.raises(TierSkipped):
        s.get(KEYS[0], 0, TOK)
    clock.t += 5.1
    s.down = False
    caplog.set_level(logging.WARNING, "kvtide")
    assert torch.equal(s.get(KEYS[0], 0, TOK), kv())  # the probe succeeds: closed
    assert s.breaker.state == "closed" and s.breaker.stats.closes == 1 and s.breaker.stats.probes == 2
    assert any("answers again" in r.getMessage() for r in caplog.records)
    s.put(KEYS[1], 0, TOK, kv(1))
    assert s.contains(KEYS[1], 0)


def test_only_one_probe_at_a_time() -> None:
    clock = Clock()
    b = CircuitBreaker("t", failures=1, backoff_s=1.0, clock=clock)
    b.failure("x")
    clock.t += 2
    assert b.allow() and not b.allow()  # the second caller is still skipped while the probe runs
    b.release()  # the probe ended in neither an answer nor a tier failure
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_per_entry_errors_are_answers_not_tier_failures(tier) -> None:
    s, _ = tier
    for layer in range(2):
        s.put(KEYS[0], layer, TOK, kv(layer))
    s.unreadable.add(KEYS[1].entry_name(0))
    for _ in range(5):
        s._poke(KEYS[0].entry_name(1), b"KVTR" + bytes(60))  # a corrupt entry (dropped as bad once read)
        with pytest.raises(ChunkCorrupt):
            s.get(KEYS[0], 1, TOK)
        with pytest.raises(ChunkMissing):
            s.get(KEYS[1], 1, TOK)
        with pytest.raises(EntryUnreadable):
            s.get(KEYS[1], 0, TOK)
        s._poke(KEYS[0].entry_name(1), b"KVTR" + bytes(60))
        got = s.get_layers(KEYS[0], [0, 1], TOK)
        assert torch.equal(got[0], kv(0)) and isinstance(got[1], ChunkCorrupt)
    assert s.breaker.state == "closed" and s.breaker.stats.failures == 0


def test_a_success_resets_the_consecutive_count(tier) -> None:
    s, _ = tier
    s.put(KEYS[0], 0, TOK, kv())
    for _ in range(4):
        s.down = True
        for _ in range(2):
            with pytest.raises(StoreUnavailable):
                s.get(KEYS[0], 0, TOK)
        s.down = False
        s.get(KEYS[0], 0, TOK)
    assert s.breaker.state == "closed" and s.breaker.stats.failures == 8 and s.breaker.stats.opens == 0


def test_nested_reads_count_once() -> None:
    """The default _read_many loops over _read: one fetch is one guarded operation, also as the probe."""
    clock = Clock()
    s = guarded(Flaky)(1 << 20, breaker=CircuitBreaker("n", failures=2, backoff_s=1.0, clock=clock))
    s.put(KEYS[0], 0, TOK, kv())
    s.down = True
    s.fetch([(KEYS[0], 0), (KEYS[1], 0)])
    assert s.breaker.stats.failures == 1 and s.breaker.state == "closed"
    s.fetch([(KEYS[0], 0)])
    assert s.breaker.state == "open"
    clock.t += 1.5
    s.down = False
    f = s.fetch([(KEYS[0], 0), (KEYS[1], 0)])  # the probe: both entries read inside it
    assert not isinstance(f.blobs[0], StoreError) and isinstance(f.blobs[1], ChunkMissing)
    assert s.breaker.state == "closed"


def test_present_tells_no_answer_from_not_stored(tier) -> None:
    s, _ = tier
    s.put(KEYS[0], 0, TOK, kv())
    wrapped = BandwidthLimitedStore(s, TokenBucket(1e9))
    assert breaker_of(wrapped) is s.breaker
    assert present(wrapped, KEYS[0], 0) and not present(wrapped, KEYS[1], 0)
    s.down = True
    with pytest.raises(StoreUnavailable):
        present(wrapped, KEYS[0], 0)
    assert s.stats.unavailable == 1
    assert not s.contains(KEYS[0], 0)  # the plain API still answers False
    plain = MemoryStore(1 << 20)
    assert breaker_of(plain) is None and not present(plain, KEYS[0], 0)


def test_thread_safe_counts() -> None:
    b = CircuitBreaker("t", failures=10_000, backoff_s=1.0)

    def fail() -> None:
        for _ in range(500):
            b.failure("x")

    ts = [threading.Thread(target=fail) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert b.stats.failures == 2000 and b.state == "closed"
    b2 = CircuitBreaker("u", failures=1, backoff_s=1.0)
    b2.failure("x")
    assert b2.state == "open"


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="failures"):
        CircuitBreaker("t", failures=0)
    with pytest.raises(ValueError, match="backoff_s"):
        CircuitBreaker("t", backoff_s=0)
    with pytest.raises(TypeError):
        guarded(int)


def test_open_tier_puts_remote_tiers_behind_a_breaker(tmp_path) -> None:
    from kvtide.store import DiskStore
    from kvtide.store.factory import open_tier

    d = open_tier(f"disk:{tmp_path / 'kv'}", breaker_failures=2, breaker_backoff_s=7.0)
    assert isinstance(d, DiskStore) and d.breaker.failures == 2 and d.breaker.backoff_s == 7.0
    d.put(KEYS[0], 0, TOK, kv())
    assert torch.equal(d.get(KEYS[0], 0, TOK), kv()) and d.breaker.state == "closed"
    assert open_tier(f"disk:{tmp_path / 'kv2'}", breaker_failures=0).breaker is None
    assert breaker_of(open_tier("memory")) is None  # in-process tiers cannot be slow or down
    with pytest.raises(ValueError, match="breaker_failures"):
        open_tier(f"disk:{tmp_path / 'kv3'}", breaker_failures=-1)
