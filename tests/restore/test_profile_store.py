"""Restoration from entries stored under KVServe profiles (RestoreConfig.store_profiles) within a quality budget.

Lossless by default: a request without a budget is restored from the lossless entries only, token for token what no
restoration gives. With a budget the plan may load a lossy profile's entries (fewer bytes), recorded as such, with the
pages' KV within the pipeline's stated error bound. A lossy entry never answers a lossless fetch, and a profile entry
that does not decode is recomputed.
"""
from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch

from kvtide import SamplingParams
from kvtide.engine.restore_port import EnginePort
from kvtide.restore.executor import RestoreExecutor, RestoreJob
from kvtide.store import MemoryStore
from kvtide.store.base import encode_record
from kvtide.store.keys import chunk_keys, profile_key
from kvtide.store.profile_entry import ProfileEntry, encode
from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer import store_codec  # noqa: F401  (the store's profile codec)
from tests.restore.restore_helpers import (
    CHUNK, fresh_store, greedy, no_restore, prefill, prefix_kv, restore_llm, text_ids, write_prefix,
)

# 4-bit groups of 32 (the stage's defaults, so its canonical spec): ~3.7x on SmolLM2 KV, relative accuracy ~1.0
LOSSY = Pipeline("none|uniform:k=4,v=4,g=32|zstd").to_spec()
EXACT = "none|none|zstd"  # a lossless pipeline: its entries must give the very tokens of the lossless ones
PROFILES = ((LOSSY, 0.99), (EXACT, 1.0))


def _llm():  # noqa: ANN202
    return restore_llm(kv_dtype="bfloat16", store_profiles=PROFILES)


def _budget(n: int, q: float) -> SamplingParams:
    return dataclasses.replace(greedy(n), kv_min_quality=q)


def _first_turn(llm, offset: int) -> tuple[list[int], list[int]]:  # noqa: ANN001
    r = llm.engine.restorer
    fresh_store(llm)
    r.profile_policy = None
    first = text_ids(llm, offset, 100)
    llm.generate(first, greedy(2))
    r.writer.flush()
    b = first + text_ids(llm, offset + 1800, 12)
    with no_restore(llm):
        ref = llm.generate(b, greedy(4))[0].token_ids
    return b, ref


def test_lossless_by_default_gives_the_tokens_of_no_restoration() -> None:
    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"
    b, ref = _first_turn(llm, 300)
    assert r.stats.profile_chunks_written == 2 * (100 // CHUNK)  # both profiles beside every lossless chunk
    out = llm.generate(b, greedy(4))[0].token_ids
    rec = r.history[-1]
    assert out == ref
    assert rec.profile is None and rec.profile_quality == 1.0 and rec.cached == [96]
    assert r.stats.profile_requests == 0 and r.stats.fallbacks == 0


def test_a_lossy_budget_loads_the_profile_with_fewer_bytes_within_its_error_bound() -> None:
    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"
    b, _ = _first_turn(llm, 700)
    llm.generate(b, greedy(1))  # lossless
    plain = r.history[-1]
    r.profile_policy = LOSSY  # the choice itself is tested below; here the profile's path
    queued = r.stats.chunks_queued
    llm.generate(b, _budget(24, 0.95))  # 112 + 24 tokens: a 4th full chunk, computed over lossy KV
    r.writer.flush()
    lossy = r.history[-1]
    assert r.stats.chunks_queued == queued  # nothing of a lossy-restored request is stored as lossless
    assert not r._tainted and not llm.engine.block_manager.uncacheable
    r.profile_policy = "lossless"
    llm.generate(b, greedy(24))  # the control: the same request restored losslessly stores that chunk
    r.writer.flush()
    assert r.stats.chunks_queued == queued + 1
    assert lossy.profile == LOSSY and lossy.profile_quality == 0.99 and lossy.cached == [96]
    assert r.stats.profile_requests == 1 and r.stats.fallbacks == 0 and lossy.failures == 0
    assert lossy.load_bytes < 0.5 * plain.load_bytes  # 4-bit codes vs BF16
    assert lossy.decode_seconds > 0
    # a lossy entry decodes within the profile's stated bound of the lossless one (+ the BF16 rounding)
    keys = chunk_keys(b[:96], r.keyspace)
    pipe = Pipeline(LOSSY)
    for layer in (0, 13, 29):
        for c, key in enumerate(keys):
            toks, pk = b[c * CHUNK:(c + 1) * CHUNK], profile_key(key, LOSSY)
            e = r.store.open(r.store.fetch([(pk, layer)]).blobs[0], pk, layer, toks, decode=False).tensor
            assert isinstance(e, ProfileEntry) and e.profile == LOSSY
            want = r.store.get(key, layer, toks).float()
            err = (e.decode().float() - want).abs()
            assert float(err.max()) <= pipe.error_bound(e.blob) + 2 ** -8 * float(want.abs().max()) + 1e-6
            assert float(err.max()) > 0  # it is lossy


def test_the_plan_picks_a_profile_only_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"
    b, ref = _first_turn(llm, 1100)
    monkeypatch.setattr(r, "bandwidth", lambda method=None: 1e6)  # a slow link (1 MB/s): bytes decide
    for q, allowed in ((1.0, {None, EXACT}), (0.995, {None, EXACT}), (0.99, {LOSSY})):
        out = llm.generate(b, _budget(4, q))[0].token_ids
        rec = r.history[-1]
        assert rec.profile in allowed, (q, rec.profile)
        if rec.profile != LOSSY:
            assert out == ref, q
    lossy = r.history[-1]
    assert lossy.profile == LOSSY  # the smallest entries the budget allows, on a link that is the bottleneck
    # a link far faster than decoding: the lossless entries (nothing to decode) plan faster
    monkeypatch.setattr(r, "bandwidth", lambda method=None: 1e13)
    assert llm.generate(b, _budget(4, 0.5))[0].token_ids == ref
    assert r.history[-1].profile is None


def test_an_exact_profile_gives_exact_tokens_and_a_corrupt_one_is_recomputed() -> None:
    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"
    b, ref = _first_turn(llm, 1500)
    r.profile_policy = EXACT
    assert llm.generate(b, greedy(4))[0].token_ids == ref
    assert r.history[-1].profile == EXACT
    # a record whose checksum holds but whose blob is not the profile's encoding: decoded, refused, recomputed
    keys = chunk_keys(b[:96], r.keyspace)
    toks = b[CHUNK:2 * CHUNK]
    junk = ProfileEntry(b"\x00" * 300, (2, CHUNK, 3, 64), EXACT)
    pk = profile_key(keys[1], EXACT)
    r.store._write(pk.entry_name(5), bytes(encode_record(pk, 5, toks, junk)))
    before = r.stats.load_failures
    assert llm.generate(b, greedy(4))[0].token_ids == ref
    assert r.history[-1].profile == EXACT
    assert r.stats.load_failures == before + 1 and r.stats.fallbacks >= 1


def test_a_lossy_entry_never_answers_a_lossless_fetch() -> None:
    """A profile's record under a lossless key (a bug or a forger) is refused by the loader, and recomputed."""
    llm = _llm()
    eng, r = llm.engine, llm.engine.restorer
    store = fresh_store(llm, MemoryStore(64 << 20))
    ids = text_ids(llm, 2300, 2 * CHUNK + 5)
    seq = prefill(eng, ids)
    write_prefix(r, seq, ids, 2 * CHUNK)
    keys = chunk_keys(ids[:2 * CHUNK], r.keyspace)
    kv = store.get(keys[0], 3, ids[:CHUNK])
    store._write(keys[0].entry_name(3), bytes(encode_record(keys[0], 3, ids[:CHUNK], encode(kv, LOSSY))))
    port = EnginePort(eng.runner, [seq])
    job = RestoreJob(ids, 0, 2 * CHUNK, len(ids), keys, [0] * r.num_layers)  # lossless: profile None
    res = RestoreExecutor(port, store, CHUNK, kv_dtype=torch.bfloat16).run([job])
    assert [(f.layer, f.chunk, f.error) for f in res.failures] == [(3, 0, "ChunkCorrupt")]
    assert res.fallback_requests == [0]
    # and the reverse: a lossless record where a profile's is expected
    pk = profile_key(keys[1], LOSSY)
    for layer in range(r.num_layers):
        store._write(pk.entry_name(layer), bytes(encode_record(pk, layer, ids[CHUNK:2 * CHUNK],
                                                               store.get(keys[1], layer, ids[CHUNK:2 * CHUNK]))))
    job = RestoreJob(ids, CHUNK, 2 * CHUNK, len(ids), [keys[0], pk], [CHUNK] * r.num_layers, profile=LOSSY)
    res = RestoreExecutor(port, store, CHUNK, kv_dtype=torch.bfloat16).run([job])
    assert {f.error for f in res.failures} == {"ChunkCorrupt"} and res.fallback_requests == [0]
    eng.block_manager.release(seq)


class _SlowProfileLookups(MemoryStore):
    """A tier whose existence checks of the named (profile) entries take 30 ms each (a distant pool); counts them."""

    delay = 0.03

    def __init__(self) -> None:
        super().__init__(256 << 20)
        self.slow: set[str] = set()
        self.checks = 0

    def _exists(self, name: str) -> bool:
        if name in self.slow:
            self.checks += 1
            time.sleep(self.delay)
        return super()._exists(name)


def test_profile_lookups_stop_at_the_steps_lookup_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile lookups share the step's ``lookup_budget_s`` with the lossless ones: on a tier whose profile checks
    take 30 ms, a 50 ms budget stops them after two checks (not the 6 of both profiles' 3 chunks), the profile that
    ran out is not used (the lossless entries serve the request) and it is counted as deferred."""
    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"
    r.profile_policy = None
    store = fresh_store(llm, _SlowProfileLookups())
    first = text_ids(llm, 1900, 100)
    llm.generate(first, greedy(2))
    r.writer.flush()
    b = first + text_ids(llm, 3700, 12)
    with no_restore(llm):
        ref = llm.generate(b, greedy(4))[0].token_ids
    store.slow = {profile_key(k, spec).entry_name(r.num_layers - 1)
                  for k in chunk_keys(b[:96], r.keyspace) for spec in (LOSSY, EXACT)}
    monkeypatch.setattr(r, "bandwidth", lambda method=None: 1e6)  # a slow link: the lossy entries plan faster
    assert r.cfg.lookup_budget_s == 0.05

    monkeypatch.setattr(r.cfg, "lookup_budget_s", None)  # the control: unbounded, every profile chunk is checked
    llm.generate(b, _budget(4, 0.95))
    assert r.history[-1].profile == LOSSY and store.checks == 6

    monkeypatch.setattr(r.cfg, "lookup_budget_s", 0.05)
    store.checks, deferred, runs = 0, r.stats.lookups_deferred, len(r.history)
    out = llm.generate(b, _budget(4, 0.95))[0].token_ids
    assert store.checks <= 2, store.checks  # 50 ms of 30 ms checks
    assert r.stats.lookups_deferred >= deferred + 1
    assert len(r.history) == runs + 1 and r.history[-1].cached == [96]  # still restored, from the lossless entries
    assert r.history[-1].profile is None and out == ref
    fresh_store(llm)


def test_profile_loads_leave_the_link_estimate_to_lossless_loads() -> None:
    """The bandwidth the planner prices lossless loads at is a link rate: loads of profile entries (fewer bytes, and
    a decode on the I/O thread) are not observed into it. Over an emulated 0.2 Gbps link, lossless loads set the
    estimate (at most the link's rate); lossy and exact profile loads between them leave it as it was."""
    from kvtide.store.bandwidth import BandwidthLimitedStore, gbps

    llm = _llm()
    r = llm.engine.restorer
    r.cfg.method = "load"  # load-only: the load-alone estimate (no replay beside the loads)
    b, ref = _first_turn(llm, 2500)
    inner = r.store
    r.use_store(BandwidthLimitedStore.at_gbps(inner, 0.2), writes=inner)
    r.profile.reset_bandwidth()
    link = gbps(0.2)
    try:
        r.profile_policy = "lossless"
        assert llm.generate(b, greedy(4))[0].token_ids == ref
        first = r.profile.solo_bandwidth
        assert first is not None and first <= 1.1 * link, (first, link)
        for spec in (LOSSY, EXACT):
            r.profile_policy = spec
            llm.generate(b, _budget(4, 0.95))
            rec = r.history[-1]
            assert rec.profile == spec and rec.load_bytes > 0 and rec.decode_seconds > 0
            assert r.profile.solo_bandwidth == first and r.profile.overlap_bandwidth is None, spec
        r.profile_policy = "lossless"
        assert llm.generate(b, greedy(4))[0].token_ids == ref
        second = r.profile.solo_bandwidth
        assert second != first and second <= 1.1 * link, (first, second, link)  # lossless loads still observed
    finally:
        r.profile_policy = None
        fresh_store(llm)


def test_profiles_fail_fast() -> None:
    from kvtide.config import RestoreConfig
    from kvtide.engine.restore_profiles import StoredProfiles

    with pytest.raises(ValueError, match="store_profiles"):
        RestoreConfig(store_profiles=(("", 0.9),))
    with pytest.raises(ValueError, match="quality"):
        RestoreConfig(store_profiles=((LOSSY, -0.5),))
    with pytest.raises(ValueError, match=re.escape("store_profiles entry 'none|uniform:k=4|nope' is not a pipeline spec")):
        StoredProfiles((("none|uniform:k=4|nope", 0.9),), CHUNK, 2)
    with pytest.raises(ValueError, match="twice"):
        StoredProfiles(((LOSSY, 0.9), ("none|uniform:k=4,v=4,g=32|zstd", 0.9)), CHUNK, 2)
    with pytest.raises(ValueError, match="kv_min_quality"):
        SamplingParams(kv_min_quality=1.5)
    assert RestoreConfig(store_profiles=[[LOSSY, 1]]).store_profiles == ((LOSSY, 1.0),)
