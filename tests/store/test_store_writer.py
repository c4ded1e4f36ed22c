"""The background writer: layer order, a failing tier counted, held() pausing writes, an asynchronous copy's
event waited on before encoding."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtide.store.base import StoreError
from kvtide.store.keys import KeySpace, chunk_keys
from kvtide.store.memory import MemoryStore
from kvtide.store.writer import StoreWriter

C = 8


def _chunk(seed: int = 0, layers: int = 3):
    ks = KeySpace("test-model", C, "bfloat16")
    toks = list(range(seed, seed + C))
    key = chunk_keys(toks, ks)[0]
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(2, C, 2, 4, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return key, toks, kv


def test_writes_every_layer_in_order():
    store = MemoryStore(1 << 20)
    w = StoreWriter(store)
    key, toks, kv = _chunk()
    w.submit(key, toks, kv)
    w.flush()
    assert not w.pending(key) and w.stats.entries == 3 and w.stats.failures == 0
    for i, x in enumerate(kv):
        assert torch.equal(store.get(key, i, toks).view(torch.int16), x.view(torch.int16))
    w.close()


def test_held_pauses_writes_until_exit_and_refuses_flush():
    store = MemoryStore(1 << 20)
    w = StoreWriter(store)
    key, toks, kv = _chunk(1)
    with w.held():
        w.submit(key, toks, kv)
        time.sleep(0.2)
        assert w.pending(key) and not store.contains(key, 0)
        with pytest.raises(RuntimeError, match="held"):
            w.flush()
    w.flush()
    assert store.contains(key, 2) and w.stats.entries == 3
    w.close()


class _Event:
    """Stands in for a CUDA event: set once the (asynchronous) copy into the host tensors has landed."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        self.done.wait(5)


def test_waits_for_the_copy_event_before_encoding():
    store = MemoryStore(1 << 20)
    w = StoreWriter(store)
    key, toks, kv = _chunk(2)
    host = [torch.zeros_like(x) for x in kv]
    ev = _Event()
    w.submit(key, toks, host, ready=ev)
    time.sleep(0.1)
    for h, x in zip(host, kv):  # the "copy" lands, then the event completes
        h.copy_(x)
    ev.done.set()
    w.flush()
    for i, x in enumerate(kv):
        assert torch.equal(store.get(key, i, toks).view(torch.int16), x.view(torch.int16))
    w.close()


class _Broken(MemoryStore):
    def put(self, *a, **k):
        raise StoreError("down", "broken")


def test_a_failing_tier_costs_the_write_not_the_thread():
    w = StoreWriter(_Broken(1 << 20))
    for s in range(2):
        key, toks, kv = _chunk(10 + s)
        w.submit(key, toks, kv)
    w.flush()
    assert w.stats.failures == 2 and w.stats.entries == 0
    w.close()


def test_admit_bounds_queued_bytes_and_an_empty_queue_takes_anything():
    w = StoreWriter(MemoryStore(1 << 20), max_bytes=100)
    key, toks, kv = _chunk(20)
    nbytes = sum(x.numel() * x.element_size() for x in kv)
    assert nbytes > 100
    with w.held():
        assert w.admit(nbytes)  # empty: admitted even though larger than the bound
        w.submit(key, toks, kv)
        assert not w.admit(1) and w.stats.refused == 1
    w.flush()
    assert w.queued_bytes == 0 and w.admit(50) and w.admit(50) and not w.admit(1)
    w.close()


class _SlowStore(MemoryStore):
    """Records the order chunks are written in; each entry takes a while (the first one until released)."""

    def __init__(self):
        super().__init__(1 << 22)
        self.order: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def put(self, key, layer, tokens, kv):
        self.started.set()
        self.release.wait(5)
        time.sleep(0.01)
        if layer == 0:
            self.order.append(key.hex)
        return super().put(key, layer, tokens, kv)


def test_wait_for_writes_the_needed_chunks_first_and_only_waits_for_them():
    store = _SlowStore()
    w = StoreWriter(store)
    chunks = [_chunk(10 * i) for i in range(6)]
    for key, toks, kv in chunks:
        w.submit(key, toks, kv)
    need = [chunks[4][0], chunks[2][0]]
    assert store.started.wait(5)  # the writer is inside chunk 0 (until released)
    threading.Timer(0.1, store.release.set).start()
    w.wait_for(need)
    assert not w.pending(need[0]) and not w.pending(need[1])
    assert store.contains(need[0], 2) and store.contains(need[1], 2)
    # chunk 0 was in progress; the needed ones came next, in the order asked, before chunks 1, 3 and 5
    assert store.order[:3] == [chunks[0][0].hex, need[0].hex, need[1].hex]
    assert any(w.pending(chunks[i][0]) for i in (1, 3, 5))  # the rest of the queue was not waited for
    w.wait_for([chunks[4][0]])  # written already: returns at once
    w.flush()
    assert store.order[3:] == [chunks[i][0].hex for i in (1, 3, 5)]
    with w.held(), pytest.raises(RuntimeError, match="held"):
        w.wait_for([chunks[1][0]])
    w.close()


class _LostCopy:
    """Stands in for a copy whose completion wait fails (a CUDA error surfacing in the writer thread)."""

    def synchronize(self):
        raise RuntimeError("device lost")


def test_an_unexpected_error_costs_the_entry_not_the_writer_thread():
    store = MemoryStore(1 << 20)
    w = StoreWriter(store)
    bad_key, bad_toks, bad_kv = _chunk(50)
    w.submit(bad_key, bad_toks, bad_kv, ready=_LostCopy())
    key, toks, kv = _chunk(60)
    w.submit(key, toks, kv)
    w.flush()  # returns: the thread survived the first entry
    assert w.stats.failures == 1 and not store.contains(bad_key, 0) and store.contains(key, 2)
    assert not w.has_pending()
    w.close()
