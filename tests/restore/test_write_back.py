"""Write-back of finished requests' chunks: bounded host bytes (a lagging tier drops chunks, counted, and they are
written at a later finish), and every written chunk equal to the KV the engine computed."""
from __future__ import annotations

from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import fresh_store, greedy, restore_llm, text_ids


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
