"""Spill on evict: device-cache pages of chunks the store lacks are written when evicted, and restore correctly.

With ``write_on_finish`` off the store gets a chunk only when its pages leave the device, so every chunk found
in the store here got there by a spill; the restored turn must equal a plain prefill's greedy tokens.
"""
from __future__ import annotations


from kvtide.engine.restoration import RestoreStats
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import fresh_store, greedy, no_restore, restore_llm, text_ids



def _spill_llm(num_pages: int | None = None):
    llm = restore_llm(prefix_caching=True, num_pages=num_pages, write_on_finish=False, spill=True)
    store = fresh_store(llm)
    llm.engine.block_manager.evict_cached()  # start from an empty device cache (spills what an earlier test left)
    llm.engine.restorer.writer.flush()
    store = fresh_store(llm)
    return llm, store


def _turn2(llm, a: list[int], out: list[int], offset: int) -> tuple[list[int], list[int]]:
    b = a + out + text_ids(llm, offset, 12)
    eng = llm.engine
    with no_restore(llm):
        eng.block_manager.enable_prefix_caching = False
        ref = llm.generate(b, greedy(2))[0].token_ids
        eng.block_manager.enable_prefix_caching = True
    return b, ref


def test_evict_cached_spills_unwritten_chunks_and_they_restore():
    llm, store = _spill_llm()
    r = llm.engine.restorer
    a = text_ids(llm, 8000, 100)
    o = llm.generate(a, greedy(3))[0]
    r.writer.flush()
    keys = chunk_keys(a + o.token_ids, r.keyspace)  # 103 tokens -> 3 full chunks of 32
    assert len(store) == 0 and r.stats.chunks_written == 0  # nothing written at finish
    llm.engine.block_manager.evict_cached()
    r.writer.flush()
    assert r.stats.chunks_spilled == 3 and r.stats.spill_missed == 0
    assert all(store.contains(k, r.num_layers - 1) for k in keys)
    b, ref = _turn2(llm, a, o.token_ids, 9000)
    out = llm.generate(b, greedy(2))[0]
    assert out.num_cached_tokens == 96 and r.history[-1].cached == [96]
    assert out.token_ids == ref and r.stats.fallbacks == 0


def test_pages_evicted_by_allocation_spill_before_reuse():
    llm, store = _spill_llm(num_pages=24)  # 384 tokens of device KV: the next requests evict the first one's pages
    r = llm.engine.restorer
    r.stats = RestoreStats()
    a = text_ids(llm, 12000, 100)
    o = llm.generate(a, greedy(3))[0]
    b, ref = _turn2(llm, a, o.token_ids, 15000)  # the plain-prefill reference first: it takes only free pages
    # Free pages, LRU first: 9 never used, then the first request's 6..0 (released tail first), then the
    # reference's. A 200-token prompt takes 13: the 9 and pages 6, 5, 4, 3, evicting chunks 2 and 1, not 0.
    llm.generate(text_ids(llm, 14000, 200), greedy(1))
    r.writer.flush()
    keys = chunk_keys(a + o.token_ids, r.keyspace)
    assert r.stats.chunks_spilled == 2 and r.stats.spill_missed == 0
    assert [store.contains(k, r.num_layers - 1) for k in keys] == [False, True, True]
    out = llm.generate(b, greedy(2))[0]
    rec = r.history[-1]
    assert rec.start == [32] and rec.cached == [96]  # chunk 0 from the device cache, chunks 1-2 from the store
    assert out.num_cached_tokens == 96 and out.token_ids == ref and r.stats.fallbacks == 0


def test_a_chunk_already_partly_gone_is_counted_not_written():
    llm, store = _spill_llm()
    r = llm.engine.restorer
    bm = llm.engine.block_manager
    r.stats = RestoreStats()
    a = text_ids(llm, 16000, 100)
    o = llm.generate(a, greedy(3))[0]
    ids = a + o.token_ids
    first = bm.match_prefix(type("S", (), {"token_ids": ids + [0]})())[:2]  # chunk 0 = pages 0 and 1
    bm._forget(first[0])  # page 0 lost without a spill (what a bug or a foreign eviction would do)
    bm.evict_cached()
    r.writer.flush()
    assert r.stats.spill_missed == 1 and r.stats.chunks_spilled == 2
    assert not store.contains(chunk_keys(ids, r.keyspace)[0], r.num_layers - 1)


def test_block_manager_hooks_see_pages_before_they_are_forgotten():
    """No model: on_release before references drop; on_evict with the LRU pages an allocation is about to
    reuse, while their hashes (and so their contents) are still there; evict_cached reports every cached page."""
    from kvtide.engine.block_manager import BlockManager
    from kvtide.engine.sampling_params import SamplingParams
    from kvtide.engine.sequence import Sequence

    bm = BlockManager(num_pages=6, page_size=4)
    seen: list = []
    bm.on_release = lambda s: seen.append(("release", s.request_id, list(s.pages)))
    bm.on_evict = lambda pids: seen.append(("evict", list(pids), [bm.page_hashes[p] is not None for p in pids]))
    a = Sequence("a", None, list(range(12)), SamplingParams())
    bm.admit(a, [])
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.commit(a)
    pages = list(a.pages)
    bm.release(a)
    assert seen == [("release", "a", pages)]
    b = Sequence("b", None, list(range(100, 116)), SamplingParams())
    bm.admit(b, [])
    assert bm.allocate(b, 16)  # 3 never-used pages, then a's tail page first
    assert seen[1] == ("evict", [pages[-1]], [True])
    bm.release(b)
    bm.evict_cached()
    assert seen[-1][0] == "evict" and set(seen[-1][1]) == set(pages[:-1]) and all(seen[-1][2])
