"""Restoration from a store that keeps entries in the ZipFusion format (RestoreConfig.store_codec="zip").

The codec is lossless, so a zip store must restore exactly what a plain store restores: the same KV bytes in the
pages and the same greedy tokens, for every method, with fewer bytes over the link.
"""
from __future__ import annotations

import pytest
import torch

from kvtide import CacheConfig, EngineConfig
from kvtide.config import RestoreConfig
from kvtide.engine.restore_port import EnginePort
from kvtide.engine.sequence import Sequence
from kvtide.restore import executor as ex
from kvtide.restore.executor import RestoreExecutor, RestoreJob
from kvtide.store import MemoryStore
from kvtide.store.base import encode_record
from kvtide.store.keys import KeySpace, chunk_keys
from kvtide.store.zip_entry import ZipEntry, from_tensor
from tests.restore.restore_helpers import (
    forced_plan, fresh_store, greedy, mixed_staircase, prefill, prefix_kv, restore_llm, text_ids, write_prefix,
)

METHODS = ["load", "cacheflow", "recompute", "cake", "layerwise"]


def _turn(llm, ids: list[int]) -> list[int]:
    return llm.generate(ids, greedy(2))[0].token_ids


def test_zip_store_restores_what_a_plain_store_restores() -> None:
    llm = restore_llm(kv_dtype="bfloat16", store_codec="zip")
    r = llm.engine.restorer
    first = text_ids(llm, 200, 100)
    b = first + text_ids(llm, 1500, 12)
    outs = {}
    for codec in (None, "zip"):
        r.cfg.store_codec = codec  # what the writer encodes; the loader reads either
        fresh_store(llm)
        llm.generate(first, greedy(2))
        r.writer.flush()
        stored = sum(len(blob) for _, blob in r.store.records()) if hasattr(r.store, "records") else None
        for m in METHODS:
            r.cfg.method = m
            outs[codec, m] = (_turn(llm, b), r.history[-1].load_bytes, r.history[-1].cached)
        with forced_plan(llm, mixed_staircase):
            outs[codec, "staircase"] = (_turn(llm, b), r.history[-1].load_bytes, r.history[-1].cached)
        outs[codec, "stored"] = stored
        assert r.stats.fallbacks == 0 and r.stats.load_failures == 0, codec
    r.cfg.store_codec, r.cfg.method = "zip", "cacheflow"
    for m in METHODS:
        assert outs["zip", m][0] == outs[None, m][0], m
        assert outs["zip", m][2] == [96], m
    assert outs["zip", "staircase"][0] == outs[None, "staircase"][0]
    assert outs["zip", "load"][1] < 0.85 * outs[None, "load"][1]  # real SmolLM2 KV: ~0.78x of the bytes
    assert outs["zip", "stored"] < 0.85 * outs[None, "stored"]
    assert outs["zip", "recompute"][1] == 0


def test_zip_store_pages_hold_the_prefill_bytes() -> None:
    """Load-only from a zip store puts exactly the prefill's KV bits in the pages (the executor's batched decode),
    and the planner charges the stored (compressed) bytes per token."""
    llm = restore_llm(kv_dtype="bfloat16", store_codec="zip")
    eng, r = llm.engine, llm.engine.restorer
    store = fresh_store(llm)
    L, n = eng.model.args.num_layers, 96
    ids = text_ids(llm, 2600, n + 8)
    with torch.inference_mode():
        base = prefill(eng, ids[:n])
        want = prefix_kv(eng, base, n)
        write_prefix(r, base, ids, n)
        keys = chunk_keys(ids[:n], r.keyspace)
        e = store.open(store._read(keys[1].entry_name(L - 1)), keys[1], L - 1, ids[32:64], decode=False).tensor
        assert isinstance(e, ZipEntry)
        for name, js in (("load", [0] * L), ("staircase", mixed_staircase(n, L))):
            seq = Sequence(name, None, list(ids), greedy(1))
            assert eng.block_manager.allocate(seq, len(ids))
            res = RestoreExecutor(EnginePort(eng.runner, [seq]), store, 32).run(
                [RestoreJob(ids, 0, n, len(ids), keys, js)])
            assert res.failures == []
            got = prefix_kv(eng, seq, n)
            if name == "load":
                assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
            else:  # loaded layers exact, replayed rows of a shorter batch within bf16 rounding
                assert all(torch.allclose(g.float(), w.float(), atol=0.05, rtol=0.02) for g, w in zip(got, want))
            eng.block_manager.release(seq)
        eng.block_manager.release(base)
    assert r.bytes_per_token < 0.85 * r.plain_bytes_per_token  # s: the records written, ~0.78x on SmolLM2 KV


def test_one_fetch_mixing_plain_and_zip_entries_decodes_each() -> None:
    """A store written both ways (codec switched on later): a fetch's device buffer holds both kinds."""
    g = torch.Generator().manual_seed(7)
    kvs = [(torch.randn(2, 32, 3, 64, generator=g) * 0.2).bfloat16() for _ in range(3)]
    entries = [from_tensor(kvs[0]), kvs[1], from_tensor(kvs[2])]
    ks = KeySpace("t", 32, "bfloat16")
    toks = list(range(32))
    key = chunk_keys(toks, ks)[0]
    store = MemoryStore(1 << 20)
    views = []
    for i, e in enumerate(entries):
        store.put(key, i, toks, e)
        views.append(store.open(store._read(key.entry_name(i)), key, i, toks, copy=False, decode=False).tensor)
    assert [isinstance(v, ZipEntry) for v in views] == [True, False, True]
    sizes = [ex._nbytes(v) for v in views]
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + -(-n // 64) * 64)
    dev = torch.zeros(offs[-1], dtype=torch.uint8)
    for k, v in enumerate(views):
        dev[offs[k]:offs[k] + sizes[k]].copy_(ex._bytes(v))
    out, offs2, sizes2 = ex._unzip(dev, views, offs, sizes)
    raw = kvs[0].numel() * 2
    assert sizes2 == [raw] * 3 and offs2 == [0, raw, 2 * raw]
    for k, kv in enumerate(kvs):
        assert torch.equal(out[k * raw:(k + 1) * raw].view(torch.int16), kv.reshape(-1).view(torch.int16)), k
    assert len(encode_record(key, 0, toks, entries[0])) < len(encode_record(key, 0, toks, kvs[0]))


def test_codec_config_is_checked() -> None:
    with pytest.raises(ValueError, match="store_codec"):
        RestoreConfig(store_codec="zstd")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(cache=CacheConfig(kv_dtype="float32"), restore=RestoreConfig(chunk_tokens=32, store_codec="zip"))


def test_zip_entry_of_another_block_size_is_a_counted_fallback() -> None:
    """A record the loader cannot decode in its one launch (blocks of 256, not 512) costs a recompute, counted; the
    tokens stay those of the intact store."""
    llm = restore_llm(kv_dtype="bfloat16", store_codec="zip")
    r = llm.engine.restorer
    first = text_ids(llm, 4200, 100)
    b = first + text_ids(llm, 5200, 12)
    fresh_store(llm)
    llm.generate(first, greedy(2))
    r.writer.flush()
    r.cfg.method = "load"
    ref = _turn(llm, b)
    key = chunk_keys(first[:96], r.keyspace)[1]
    kv = r.store.get(key, 3, first[32:64])
    r.store.put(key, 3, first[32:64], from_tensor(kv, block_size=256))
    n0 = r.stats.load_failures
    out = _turn(llm, b)
    r.cfg.method = "cacheflow"
    assert out == ref and r.stats.load_failures > n0
    r.writer.flush()  # the finished turn rewrote the chunk it recomputed: damage it again for the executor alone
    healed = r.store.open(r.store._read(key.entry_name(3)), key, 3, first[32:64], decode=False).tensor
    assert healed.block_size == 512 and torch.equal(healed.decode().view(torch.int16), kv.view(torch.int16))
    r.store.put(key, 3, first[32:64], from_tensor(kv, block_size=256))
    eng, L = llm.engine, llm.engine.model.args.num_layers
    seq = Sequence("bs", None, list(b), greedy(1))
    assert eng.block_manager.allocate(seq, len(b))
    with torch.inference_mode():
        res = RestoreExecutor(EnginePort(eng.runner, [seq]), r.store, 32).run(
            [RestoreJob(b, 0, 96, len(b), chunk_keys(first[:96], r.keyspace), [0] * L)])
    eng.block_manager.release(seq)
    assert [(f.layer, f.chunk, f.error) for f in res.failures] == [(3, 1, "ChunkCorrupt")]
    assert "blocks of 256" in res.failures[0].message and res.fallback_requests == [0]
