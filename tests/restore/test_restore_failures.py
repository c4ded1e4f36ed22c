"""A bad, missing or unreachable chunk never yields garbage: the executor recomputes from the first bad token,
the output equals a plain prefill's, and the fallback is counted (restorer and store stats)."""
from __future__ import annotations

from collections import OrderedDict

import pytest

from kvtide.store import RedisStore
from kvtide.store.base import encode_record
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import FailAfter, fresh_store, greedy, restore_llm, two_turns

try:
    from tests.store.conftest import RedisServer, need_redis
except ImportError:  # run from another root
    RedisServer = need_redis = None  # type: ignore[assignment]



def _damage(store, key, layer: int, kind: str, tokens) -> None:
    name = key.entry_name(layer)
    blob = store._read(name)
    if kind == "corrupt":
        b = bytearray(blob)
        b[-7] ^= 0x40
        store._poke(name, bytes(b))
    elif kind == "truncated":
        store._poke(name, blob[:-100])
    elif kind == "missing":
        store.delete(key, layer)
    elif kind == "token_mismatch":
        kv = store.get(key, layer, tokens)
        store._poke(name, encode_record(key, layer, [t ^ 1 for t in tokens], kv))


@pytest.fixture(scope="module")
def turn():
    """Turn 1 run once (its chunks in a memory store), turn 2's prompt and its plain-prefill tokens, a snapshot."""
    llm = restore_llm()
    store = fresh_store(llm)
    b, ref = two_turns(llm, 7000, first=100, extra=12, out=2)
    return llm, b, ref, OrderedDict(store._data)


def _reset(llm, snapshot):
    """A fresh store holding exactly turn 1's entries."""
    store = fresh_store(llm)
    store._data = OrderedDict(snapshot)
    store._used = sum(len(v) for v in snapshot.values())
    return store


@pytest.mark.parametrize("kind,counter", [("corrupt", "corrupt"), ("truncated", "truncated"),
                                          ("missing", "misses"), ("token_mismatch", "token_mismatch")])
def test_bad_chunk_falls_back_to_recompute(turn, kind: str, counter: str):
    llm, b, ref, snapshot = turn
    r = llm.engine.restorer
    store = _reset(llm, snapshot)
    r.cfg.method = "load"
    key = chunk_keys(b[:96], r.keyspace)[1]
    _damage(store, key, 7, kind, b[32:64])
    out = llm.generate(b, greedy(2))[0]
    r.cfg.method = "cacheflow"
    assert out.token_ids == ref
    rec = r.history[-1]
    assert rec.failures == 1 and rec.fallback_tokens == len(b) - 32  # from the bad chunk's first token on
    assert r.stats.fallbacks == 1 and r.stats.load_failures == 1
    assert store.stats.snapshot()[counter] == 1


def test_failure_mid_load_falls_back(turn):
    llm, b, ref, snapshot = turn
    r = llm.engine.restorer
    store = _reset(llm, snapshot)
    r.cfg.method = "load"
    r.store = FailAfter(store, ok=40)  # dies in layer 13 of 30 (3 chunks a layer)
    out = llm.generate(b, greedy(2))[0]
    r.store = store
    r.cfg.method = "cacheflow"
    assert out.token_ids == ref
    assert r.stats.fallbacks == 1 and r.stats.load_failures >= 1
    assert r.history[-1].fallback_tokens == len(b)  # load-only: nothing below position 0 was restored in every layer


def test_dead_redis_falls_back():
    if need_redis is None:
        pytest.skip("tests.store.conftest not importable")
    need_redis()
    import tempfile
    from pathlib import Path

    srv = RedisServer(Path(tempfile.mkdtemp()))
    llm = restore_llm()
    r = llm.engine.restorer
    try:
        store = fresh_store(llm, RedisStore(port=srv.port, socket_timeout=0.5))
        b, ref = two_turns(llm, 11000, first=100, extra=12, out=2)
        assert store.contains(chunk_keys(b[:96], r.keyspace)[2], r.num_layers - 1)
    finally:
        srv.stop()
    # dead at lookup: plain prefill, the unreachable tier counted
    out = llm.generate(b, greedy(2))[0]
    assert out.token_ids == ref and out.num_cached_tokens == 0
    assert store.stats.unavailable >= 1
    # dead between lookup and load (lookup said yes): every load fails, recompute, counted
    r._present = lambda key: True
    try:
        out = llm.generate(b, greedy(2))[0]
    finally:
        del r._present
    assert out.token_ids == ref
    assert r.stats.fallbacks == 1 and r.stats.load_failures >= 1
    fresh_store(llm)
