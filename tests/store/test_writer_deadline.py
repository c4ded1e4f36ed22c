"""Writer deadlines and honest counts: flush/close(timeout) return by the deadline with what is left dropped (counted,
logged once); a chunk counts as written only when the tier stored every layer."""
from __future__ import annotations

import logging
import threading
import time

import torch

from kvtide.log import reset_limits
from kvtide.store import KeySpace, MemoryStore, StoreUnavailable, chunk_keys
from kvtide.store.writer import StoreWriter

C = 8


def _chunks(n: int, layers: int = 2):
    ks = KeySpace("deadline", C, "bfloat16")
    toks = list(range(n * C))
    keys = chunk_keys(toks, ks)
    kv = [torch.zeros(2, C, 1, 4, dtype=torch.bfloat16) for _ in range(layers)]
    return [(k, toks[i * C:(i + 1) * C], list(kv)) for i, k in enumerate(keys)]


class Stalled(MemoryStore):
    """Every write waits like a SIGSTOPped server (until released), then succeeds."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()

    def _write(self, name, blob):
        self.gate.wait(30)
        return super()._write(name, blob)


class Dead(MemoryStore):
    def _write(self, name, blob):
        raise StoreUnavailable("tier down")


def test_close_returns_by_its_deadline_and_counts_what_it_dropped(caplog) -> None:
    reset_limits()
    store = Stalled()
    got: list[tuple[str, bool]] = []
    w = StoreWriter(store, flush_timeout=0.3, on_chunk=lambda k, ok: got.append((k.hex, ok)))
    chunks = _chunks(16)
    for key, toks, kv in chunks:
        w.submit(key, toks, kv)
    caplog.set_level(logging.WARNING, "kvtide")
    t0 = time.perf_counter()
    assert w.close() is False  # the default deadline: flush_timeout
    took = time.perf_counter() - t0
    assert took < 1.0, took  # was unbounded: 16 chunks x 2 stalled writes
    assert w.stats.dropped == 15 and w.stats.chunks == 0  # the one being written is left to finish on its own
    assert sorted(h for h, ok in got if not ok) == sorted(k.hex for k, _, _ in chunks[1:])
    msgs = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(msgs) == 1 and "15 queued chunks" in msgs[0]
    assert w.queued_bytes == 0 and all(not w.pending(k) for k, _, _ in chunks[1:])
    late = _chunks(17)[16]
    w.submit(*late)  # after close: dropped, counted, never queued
    assert w.stats.dropped == 16 and not w.pending(late[0])
    store.gate.set()  # the write in flight completes: it alone is written
    deadline = time.monotonic() + 10
    while w.stats.chunks == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.stats.chunks == 1 and (chunks[0][0].hex, True) in got
    assert store.contains(chunks[0][0], 1) and not store.contains(chunks[1][0], 0)


def test_flush_timeout_drops_the_queue_and_later_writes_go_on() -> None:
    store = Stalled()
    w = StoreWriter(store)
    chunks = _chunks(4)
    for c in chunks:
        w.submit(*c)
    t0 = time.perf_counter()
    assert w.flush(timeout=0.2) is False
    assert time.perf_counter() - t0 < 0.8 and w.stats.dropped == 3
    store.gate.set()
    assert w.flush(timeout=10) is True
    w.submit(*chunks[2])
    assert w.flush() is True and w.stats.chunks == 2
    assert w.close(timeout=5) is True


def test_wait_for_gives_up_at_its_timeout_and_keeps_the_chunks_queued() -> None:
    store = Stalled()
    w = StoreWriter(store)
    chunks = _chunks(2)
    for c in chunks:
        w.submit(*c)
    t0 = time.perf_counter()
    assert w.wait_for([chunks[1][0]], timeout=0.2) is False
    assert time.perf_counter() - t0 < 0.8 and w.pending(chunks[1][0]) and w.stats.dropped == 0
    store.gate.set()
    assert w.wait_for([chunks[1][0]], timeout=10) is True
    w.close(timeout=5)


def test_failed_or_declined_writes_never_count_as_written() -> None:
    got: list[bool] = []
    w = StoreWriter(Dead(1 << 20), on_chunk=lambda k, ok: got.append(ok))
    for c in _chunks(3):
        w.submit(*c)
    assert w.flush(timeout=10)
    assert (w.stats.chunks, w.stats.entries, w.stats.failures) == (0, 0, 3) and got == [False] * 3
    w.close()
    tiny = MemoryStore(200)  # smaller than one record: every put is declined
    w = StoreWriter(tiny, on_chunk=lambda k, ok: got.append(ok))
    c = _chunks(1)[0]
    w.submit(*c)
    assert w.flush(timeout=10)
    assert (w.stats.chunks, w.stats.entries, w.stats.declined) == (0, 0, 1) and got[-1] is False
    assert tiny.stats.puts == 0 and not tiny.contains(c[0], 1)
    w.close()
