"""Write-back of finished requests' chunks: bounded host bytes (a lagging tier drops chunks, counted, and they are
written at a later finish), a lookup that needs queued chunks waits for those alone."""
from __future__ import annotations

import threading

from kvtide.store.keys import chunk_keys
from kvtide.store.memory import MemoryStore
from tests.restore.restore_helpers import fresh_store, greedy, no_restore, restore_llm, text_ids


def test_write_queue_bound_drops_chunks_counted_and_a_later_finish_writes_them():
    llm = restore_llm()
    store = fresh_store(llm)
    r = llm.engine.restorer
    r.writer.max_bytes = 1  # anything queued fills the bound
    a, b = text_ids(llm, 3000, 70), text_ids(llm, 5000, 70)
    ka, kb = chunk_keys(a, r.keyspace), chunk_keys(b, r.keyspace)  # 2 full chunks of 32 each
    with r.writer.held():  # the tier "lags": nothing drains while held
        llm.generate(a, greedy(2))
        assert r.writer.queued_bytes > 0
        llm.generate(b, greedy(2))  # the queue is not empty: b's chunks are turned away
    r.writer.flush()
    assert r.stats.writes_dropped == len(kb) == 2 and r.writer.stats.refused == 1
    assert r.writer.queued_bytes == 0
    assert all(store.contains(k, r.num_layers - 1) for k in ka)
    assert not any(store.contains(k, 0) for k in kb)
    llm.generate(b, greedy(2))  # b finishes again with room: its chunks were not marked written, so they are now
    r.writer.flush()
    assert all(store.contains(k, r.num_layers - 1) for k in kb)
    r.writer.max_bytes = llm.engine.config.restore.write_queue_bytes


class _GatedStore(MemoryStore):
    """A slow tier: the first write waits until released; records the order chunks' first layers are written."""

    def __init__(self):
        super().__init__(256 << 20)
        self.order: list[str] = []
        self.started, self.gate = threading.Event(), threading.Event()

    def put(self, key, layer, tokens, kv):
        self.started.set()
        self.gate.wait(10)
        if layer == 0:
            self.order.append(key.hex)
        return super().put(key, layer, tokens, kv)


def test_lookup_of_queued_chunks_writes_them_first_and_restores_the_same_tokens():
    llm = restore_llm()
    store = _GatedStore()
    fresh_store(llm, store)
    r = llm.engine.restorer
    c, a = text_ids(llm, 6000, 100), text_ids(llm, 7000, 70)
    b = a + text_ids(llm, 8000, 12)
    with no_restore(llm):
        ref = llm.generate(b, greedy(3))[0].token_ids
    llm.generate(c, greedy(2))  # c's 3 chunks queued first; the writer is stuck in c's first one
    assert store.started.wait(10)
    llm.generate(a, greedy(2))  # a's 2 chunks queued behind c's
    ka, kc = chunk_keys(a, r.keyspace), chunk_keys(c, r.keyspace)
    assert all(r.writer.pending(k) for k in ka + kc[1:])
    threading.Timer(0.2, store.gate.set).start()
    out = llm.generate(b, greedy(3))[0]  # its lookup needs a's chunks: they go to the head of the queue
    assert out.num_cached_tokens == 64 and out.token_ids == ref
    assert r.stats.write_wait_seconds > 0
    pos = {h: i for i, h in enumerate(store.order)}
    assert max(pos[k.hex] for k in ka) < min(pos.get(k.hex, len(pos)) for k in kc[1:])
    r.writer.flush()
    assert all(store.contains(k, r.num_layers - 1) for k in kc)
