"""Slow and dead backends through the engine: a SIGSTOPped Redis costs a request at most one store timeout (correct
tokens, plain prefill) and, once its breaker is open, nothing; store lookups of a step stop at their time budget;
a chunk whose write failed is neither counted as written nor forgotten for rewriting."""
from __future__ import annotations

import gc
import time
from pathlib import Path

from kvtide import CacheConfig
from kvtide.config import RestoreConfig
from kvtide.engine.llm import LLM
from kvtide.store import MemoryStore, StoreUnavailable
from kvtide.store.breaker import breaker_of, present
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import CHUNK, fresh_store, greedy, no_restore, restore_llm, text_ids
from tests.store.redis_procs import Server

TIMEOUT = 2.0  # seconds; large beside a plain run of these prompts on a loaded 2-core machine (~0.5 s)


def _timed(llm: LLM, prompt: list[int], n: int = 4):
    t0 = time.perf_counter()
    out = llm.generate(prompt, greedy(n))[0]
    return out, time.perf_counter() - t0


def test_sigstopped_redis_costs_one_timeout_then_nothing_while_the_breaker_is_open(tmp_path: Path) -> None:
    srv = Server(tmp_path)
    llm = LLM("smollm2-135m", progress=False, cache=CacheConfig(kv_dtype="float32", enable_prefix_caching=False),
              restore=RestoreConfig(chunk_tokens=CHUNK, store=f"redis://127.0.0.1:{srv.port}?prefix=slow:",
                                    store_timeout_s=TIMEOUT, breaker_failures=2, breaker_backoff_s=600.0))
    r = llm.engine.restorer
    try:
        turns = []
        for offset in (3000, 9000, 15000):  # three conversations whose first turns are in Redis
            a = text_ids(llm, offset, 90)
            o = llm.generate(a, greedy(4))[0]
            turns.append(a + o.token_ids + text_ids(llm, offset + 2000, 20))
        assert r.writer.flush(timeout=30)
        assert all(present(r.store, chunk_keys(b[:64], r.keyspace)[1], r.num_layers - 1) for b in turns)
        with no_restore(llm):
            refs = [_timed(llm, b) for b in turns]
        plain = max(dt for _, dt in refs)
        srv.pause()

        out, dt = _timed(llm, turns[0])  # its lookup waits one timeout, then plain prefill
        assert out.token_ids == refs[0][0].token_ids and out.num_cached_tokens == 0
        assert dt <= 2 * TIMEOUT and dt - plain < 1.5 * TIMEOUT, (dt, plain)  # one timeout, not one per chunk
        assert r.stats.lookup_failures == 1
        assert r.writer.flush(timeout=10)  # its new chunk's write fails after one timeout: the second failure
        b = breaker_of(r.store)
        assert b.state == "open" and r.stats.chunks_written == r.stats.chunks_queued - r.stats.write_failures

        skipped = b.stats.skipped
        for i in (1, 2):  # the breaker is open: no store round trip, the cost of a plain run
            out, dt = _timed(llm, turns[i])
            assert out.token_ids == refs[i][0].token_ids and out.num_cached_tokens == 0
            assert dt < plain + 0.5 * TIMEOUT, (dt, plain)
        assert b.stats.skipped > skipped and r.stats.lookup_failures == 3
        t0 = time.perf_counter()
        assert r.writer.close(timeout=5)  # the writes of those requests are skipped at once too
        assert time.perf_counter() - t0 < 0.5 * TIMEOUT
    finally:
        srv.stop()  # SIGCONT, then terminate, by its pid
        r.close()
        del llm, r
        gc.collect()


class SlowLookups(MemoryStore):
    """A tier whose existence checks take 30 ms each (a distant Redis); counts them."""

    delay = 0.03

    def __init__(self) -> None:
        super().__init__(256 << 20)
        self.checks = 0

    def _exists(self, name: str) -> bool:
        self.checks += 1
        time.sleep(self.delay)
        return super()._exists(name)


def test_a_steps_lookups_stop_at_the_budget_and_the_rest_is_prefilled() -> None:
    llm = restore_llm()
    r = llm.engine.restorer
    assert r.cfg.lookup_budget_s == 0.05
    store = fresh_store(llm, SlowLookups())
    prompts = []
    for offset in (21000, 23000, 25000, 27000):
        a = text_ids(llm, offset, 100)  # 3 chunks each in the store
        llm.generate(a, greedy(2))
        prompts.append(a + text_ids(llm, offset + 1000, 10))
    r.writer.flush()
    with no_restore(llm):
        refs = [llm.generate(p, greedy(3))[0].token_ids for p in prompts]
    per_step: list[int] = []
    step = r.step

    def counted_step():
        before = store.checks
        try:
            return step()
        finally:
            per_step.append(store.checks - before)

    r.step = counted_step
    try:
        outs = llm.generate(prompts, greedy(3))
    finally:
        del r.step
    assert [o.token_ids for o in outs] == refs
    # 50 ms of 30 ms checks: at most 2 a step (unbounded, the first step checked ~4 chunks of all 4 requests)
    assert max(per_step) <= 2, per_step
    assert r.stats.lookups_deferred >= 1
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 1  # what was looked up in time was restored
    fresh_store(llm)


class DeadThenAlive(MemoryStore):
    def __init__(self) -> None:
        super().__init__(256 << 20)
        self.dead = True

    def _write(self, name: str, blob: bytes):
        if self.dead:
            raise StoreUnavailable("tier down")
        return super()._write(name, blob)


def test_failed_writes_are_not_counted_as_written_and_are_written_again_later() -> None:
    llm = restore_llm()
    r = llm.engine.restorer
    store = fresh_store(llm, DeadThenAlive())
    a = text_ids(llm, 31000, 100)
    llm.generate(a, greedy(2))
    r.writer.flush()
    keys = chunk_keys(a[:96], r.keyspace)
    assert r.stats.chunks_queued == 3 and r.stats.chunks_written == 0 and r.stats.write_failures == 3
    assert store.stats.puts == 0 and r.writer.stats.chunks == 0
    store.dead = False
    llm.generate(a, greedy(2))  # the same prefix again: its chunks were forgotten as unwritten, so written now
    r.writer.flush()
    assert r.stats.chunks_written == 3 and all(store.contains(k, r.num_layers - 1) for k in keys)
    fresh_store(llm)


def test_bad_backend_settings_name_the_field() -> None:
    import pytest

    for field, bad in (("store_timeout_s", 0), ("store_timeout_s", None), ("breaker_backoff_s", -1.0),
                       ("lookup_budget_s", float("inf")), ("flush_timeout_s", "5"), ("breaker_failures", -1),
                       ("breaker_failures", 1.5)):
        with pytest.raises(ValueError, match=f"RestoreConfig.{field}"):
            RestoreConfig(**{field: bad})
    ok = RestoreConfig(lookup_budget_s=None, flush_timeout_s=None, breaker_failures=0)
    assert ok.lookup_budget_s is None and ok.breaker_failures == 0


def test_chunks_a_tier_lost_are_written_again() -> None:
    """A tier that lost entries (evicted, expired, a Redis restarted empty): the lookup's miss makes the restorer
    forget it wrote them, so the request that prefilled them instead writes them back and the next one restores."""
    llm = restore_llm()
    fresh_store(llm)
    r = llm.engine.restorer
    a = text_ids(llm, 4000, 3 * CHUNK + 5)
    first = llm.generate(a, greedy(2))[0]
    assert r.writer.flush(timeout=30)
    keys = chunk_keys(a + first.token_ids, r.keyspace)
    assert keys and all(r.store.contains(k, r.num_layers - 1) for k in keys)
    for k in keys:  # the tier loses everything behind the engine's back
        for layer in range(r.num_layers):
            r.store.delete(k, layer)
    before = r.stats.restorations
    assert llm.generate(a, greedy(2))[0].token_ids == first.token_ids  # a miss: plain prefill
    assert r.stats.restorations == before
    assert r.writer.flush(timeout=30)
    assert all(r.store.contains(k, r.num_layers - 1) for k in keys), "lost chunks must be written again"
    assert llm.generate(a, greedy(2))[0].token_ids == first.token_ids
    assert r.stats.restorations == before + 1
