"""The executor's load path: batched fetches, read-ahead, parallel verify, one-by-one stores, link overlap.

Every variant must place exactly the bytes a prefill writes (bf16 KV, load-only staircase), and the bulk path must
keep the emulated link busy while the CPU verifies: load time ~ link time, not link time + verify time.
"""
from __future__ import annotations

import time

import pytest
import torch

from kvtide.engine.restore_port import EnginePort
from kvtide.engine.sequence import Sequence
from kvtide.restore.executor import LoadConfig, RestoreExecutor, RestoreJob
from kvtide.store import BandwidthLimitedStore, TokenBucket
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import (
    CHUNK, EntryByEntry, fresh_store, greedy, prefill, prefix_kv, restore_llm, text_ids, write_prefix,
)

N = 96



@pytest.fixture(scope="module")
def stored():
    """A bf16 engine whose store holds a 96-token prefix, the prefill's KV of it, and its keys."""
    llm = restore_llm(kv_dtype="bfloat16")
    eng, r = llm.engine, llm.engine.restorer
    store = fresh_store(llm)
    ids = text_ids(llm, 6000, N + 12)
    with torch.inference_mode():
        base = prefill(eng, ids[:N])
        want = prefix_kv(eng, base, N)
        write_prefix(r, base, ids, N)
        eng.block_manager.release(base)
    return llm, store, ids, want, chunk_keys(ids[:N], r.keyspace)


def _run(llm, store, ids, keys, js, load: LoadConfig | None = None):
    eng = llm.engine
    seq = Sequence(f"t{time.perf_counter_ns()}", None, list(ids), greedy(1))
    assert eng.block_manager.allocate(seq, len(ids))
    with torch.inference_mode():
        res = RestoreExecutor(EnginePort(eng.runner, [seq]), store, CHUNK, load).run(
            [RestoreJob(ids, 0, N, len(ids), keys, js)])
    got = prefix_kv(eng, seq, N)
    eng.block_manager.release(seq)
    return res, got


E = 24_960  # the executor's estimate of one entry's bytes here (3 KV heads x 64, 32 tokens): sizes batches
_layers = lambda ld: sum(1 for k in ld if k)  # noqa: E731 - layers that load anything


@pytest.mark.parametrize("load,fetches", [
    (LoadConfig(), _layers),  # a fetch per layer
    (LoadConfig(merge_layers=4), lambda ld: -(-_layers(ld) // 4)),  # bytes never bind: 4 layers a fetch
    (LoadConfig(batch_bytes=1, read_ahead=0), sum),  # one entry a fetch, no read-ahead
    (LoadConfig(batch_bytes=30_000, read_ahead=2, workers=2), sum),  # one entry a fetch, parallel verify
    (LoadConfig(batch_bytes=4 * E, merge_layers=4), lambda ld: -(-sum(ld) // 4)),  # layers split across fetches
    (LoadConfig(batch_bytes=20 * E, merge_layers=2), lambda ld: -(-_layers(ld) // 2)),  # the layer cap binds
])
@pytest.mark.parametrize("stair", ["load-only", "staircase"])
def test_bulk_loads_place_the_prefill_bytes(stored, load: LoadConfig, fetches, stair: str) -> None:
    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    js = [0] * L if stair == "load-only" else [min(2, max(0, 2 - i)) * CHUNK for i in range(L)]  # 64, 32, 0, ...
    res, got = _run(llm, store, ids, keys, js, load)
    loaded = [N // CHUNK - j // CHUNK for j in js]  # entries per layer
    assert res.failures == [] and res.loaded_entries == sum(loaded) and res.loaded_tokens == CHUNK * sum(loaded)
    assert res.load_batches == fetches(loaded)
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))


def test_store_without_fetch_loads_entry_by_entry(stored) -> None:
    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    res, got = _run(llm, EntryByEntry(store), ids, keys, [0] * L)
    assert res.failures == [] and res.loaded_entries == L * N // CHUNK
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))


class SlowOpen:
    """Verification that costs ``delay`` seconds an entry (a slow CPU): the link should not wait for it."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def open(self, *a, **kw):  # noqa: ANN002, ANN003
        time.sleep(self.delay)
        return self.inner.open(*a, **kw)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("load", [
    LoadConfig(read_ahead=1, merge_layers=1),  # a fetch per layer
    LoadConfig(read_ahead=1, batch_bytes=6 * E, merge_layers=4),  # two layers a fetch (bytes bind)
])
def test_link_moves_the_next_batch_while_this_one_is_verified(stored, load: LoadConfig) -> None:
    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    entry = len(store._read(keys[0].entry_name(0)))
    rate = entry / 0.004  # 4 ms of link per entry, 12 ms per layer
    link = SlowOpen(BandwidthLimitedStore(store, TokenBucket(rate)), 0.003)  # 9 ms of verify per layer
    res, got = _run(llm, link, ids, keys, [0] * L, load)
    assert res.load_batches == (L if load.merge_layers == 1 else -(-L // 2))
    link_s = res.load_bytes / rate
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
    # serial would be link + verify = 1.75x link; overlapped is link + one batch of verify
    assert res.load_seconds < 1.25 * link_s, (res.load_seconds, link_s)
    assert res.load_seconds >= 0.95 * link_s


class SlowStaircase:
    """A port whose prefix replay (rows from position 0) is ``delay`` slower a layer: compute slower than planned."""

    def __init__(self, port, delay: float) -> None:
        self.port, self.delay = port, delay

    def run_layer(self, layer, h, segments):  # noqa: ANN001
        if segments and segments[0].start == 0:
            time.sleep(self.delay)
        return self.port.run_layer(layer, h, segments)

    def __getattr__(self, name: str):
        return getattr(self.port, name)


def _steal_run(llm, store, ids, keys, js, steal: bool, delay: float = 0.02, profile=None):
    eng = llm.engine
    seq = Sequence(f"s{time.perf_counter_ns()}", None, list(ids), greedy(1))
    assert eng.block_manager.allocate(seq, len(ids))
    with torch.inference_mode():
        res = RestoreExecutor(SlowStaircase(EnginePort(eng.runner, [seq]), delay), store, CHUNK,
                              LoadConfig(steal=steal)).run([RestoreJob(ids, 0, N, len(ids), keys, js)],
                                                           profile=profile)
    got = prefix_kv(eng, seq, N)
    eng.block_manager.release(seq)
    return res, got


def test_idle_link_steals_recompute_and_the_result_is_unchanged(stored) -> None:
    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    js = [N] * L  # a plan that trusted compute entirely; compute then runs 20 ms a layer slower
    slow, _ = _steal_run(llm, store, ids, keys, js, steal=False)
    res, got = _steal_run(llm, store, ids, keys, js, steal=True)
    assert slow.stolen_tokens == 0 and res.stolen_tokens > 0 and res.failures == []
    b = res.boundaries[0]
    assert all(x >= y for x, y in zip(b, b[1:])) and all(x % CHUNK == 0 for x in b) and b[0] == N  # a staircase
    assert res.loaded_tokens == res.stolen_tokens == sum(N - x for x in b)
    assert res.recomputed_tokens == sum(b)
    assert res.total_seconds < 0.8 * slow.total_seconds  # the link took work the slow compute would have done
    for layer, (g, w) in enumerate(zip(got, want)):
        j = b[layer] // 16  # pages: the stolen part is the prefill's exact bytes, the rest recomputed
        assert torch.equal(g[j:].view(torch.int16), w[j:].view(torch.int16))
        assert torch.allclose(g[:j].float(), w[:j].float(), atol=0.05, rtol=0.02)
    assert torch.allclose(res.logits, slow.logits, atol=0.05, rtol=0.02)
    assert res.logits.argmax(-1).tolist() == slow.logits.argmax(-1).tolist()


def test_the_load_rate_is_learned_from_the_plans_loads_not_the_stolen_ones(stored) -> None:
    """Stolen chunks go one at a time, the link idle while each is verified and placed; a plan's loads keep it busy
    (read-ahead). Counting the steals in the rate would understate what a plan's loads get, and plans made with it
    would recompute more and leave the link idle for more stealing."""
    from kvtide.restore.profile import LatencyProfile

    llm, store, ids, _, keys = stored
    L = llm.engine.model.args.num_layers
    entry = len(store._read(keys[0].entry_name(0)))
    link = SlowOpen(BandwidthLimitedStore(store, TokenBucket(entry / 0.004)), 0.003)  # 4 ms link, 3 ms verify
    prof = LatencyProfile()
    res, _ = _steal_run(llm, link, ids, keys, [N - CHUNK] * L, steal=True, profile=prof)  # plan loads one chunk
    assert res.stolen_tokens > 0 and res.failures == []
    assert 0 < res.planned_load_bytes < res.load_bytes and 0 < res.planned_load_seconds < res.load_seconds
    assert prof.overlap_bandwidth == pytest.approx(res.planned_load_bytes / res.planned_load_seconds)
    assert prof.overlap_bandwidth > 1.3 * res.load_bytes / res.load_seconds  # what the whole span would have said
    plain, _ = _steal_run(llm, store, ids, keys, [N - CHUNK] * L, steal=False)
    assert plain.planned_load_bytes == plain.load_bytes and plain.planned_load_seconds == plain.load_seconds


def test_a_failed_stolen_load_falls_back(stored) -> None:
    from tests.restore.restore_helpers import FailAfter

    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    ref, _ = _steal_run(llm, store, ids, keys, [N] * L, steal=False, delay=0.0)
    res, _ = _steal_run(llm, FailAfter(store, ok=0), ids, keys, [N] * L, steal=True)
    assert res.failures and res.fallback_requests == [0]
    assert res.fallback_tokens == len(ids) - res.failures[0].position  # from the stolen chunk's first token on
    assert torch.allclose(res.logits, ref.logits, atol=0.05, rtol=0.02)
    assert res.logits.argmax(-1).tolist() == ref.logits.argmax(-1).tolist()


def test_cacheflow_plans_compute_heavy_with_stealing_and_predicts_the_unbiased_optimum() -> None:
    from types import SimpleNamespace

    from kvtide.restore.methods import make_plan
    from kvtide.restore.costs import RestoreRequest

    llm = restore_llm()
    r = llm.engine.restorer
    for n in (64, 128, 256, 512):
        r.profile.observe(n, 1e-3 + 8e-5 * n, blocks=1)
    r.profile.observe_load(2e6, 1.0)  # a link where the trade-off is real
    picked = [(SimpleNamespace(num_tokens=520), 0, 512, []), (SimpleNamespace(num_tokens=300), 0, 288, [])]
    reqs = [RestoreRequest(512, 8), RestoreRequest(288, 12)]
    plain = make_plan("cacheflow", reqs, r.cost(2), r.bandwidth(), r.chunk)
    old = (r.cfg.hedge, r.cfg.steal, r.cfg.method)
    try:
        r.cfg.method = "cacheflow"
        r.cfg.hedge, r.cfg.steal = 0.2, True
        p = r.plan_for(picked)
        assert p.predicted_seconds == pytest.approx(plain.predicted_seconds)
        assert sum(map(sum, p.boundaries)) > sum(map(sum, plain.boundaries))  # more recompute planned
        assert all(x >= y for js in p.boundaries for x, y in zip(js, js[1:]))
        r.cfg.steal = False  # nothing would take the surplus back: plan unbiased
        assert r.plan_for(picked).boundaries == plain.boundaries
    finally:
        r.cfg.hedge, r.cfg.steal, r.cfg.method = old


def test_suffix_layers_are_marked_paced_only_when_their_loads_were_late(stored) -> None:
    """A suffix layer reached before its loads were in is marked paced (the planner does not learn suffix cost from
    it on CUDA); recompute-only has nothing to wait for, and a slow link paces the later layers of a load-only run."""
    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    res, _ = _run(llm, store, ids, keys, [N] * L)
    assert len(res.suffix_layer_paced) == L == len(res.suffix_layer_seconds) and not any(res.suffix_layer_paced)
    entry = len(store._read(keys[0].entry_name(0)))
    link = BandwidthLimitedStore(store, TokenBucket(entry / 0.004))  # 12 ms of link a layer
    # a fetch per layer: merged fetches would make every layer of a fetch ready at once
    res, got = _run(llm, link, ids, keys, [0] * L, LoadConfig(read_ahead=1, merge_layers=1))
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
    assert len(res.suffix_layer_paced) == L and sum(res.suffix_layer_paced) >= L // 2


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_merge_layers_must_be_a_positive_int(bad) -> None:
    from kvtide.config import RestoreConfig

    with pytest.raises(ValueError, match="merge_layers"):
        LoadConfig(merge_layers=bad)
    with pytest.raises(ValueError, match="merge_load_layers"):
        RestoreConfig(merge_load_layers=bad)


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2"])
def test_load_workers_must_be_none_or_a_count(bad) -> None:
    from kvtide.config import RestoreConfig

    with pytest.raises(ValueError, match="load_workers"):
        RestoreConfig(load_workers=bad)
    assert RestoreConfig(load_workers=4).load_workers == 4


def test_loads_beside_a_replay_feed_the_overlapped_estimate(stored) -> None:
    """A hybrid plan's loads are observed as overlapped, a load-only plan's as alone; plans read the matching one."""
    from types import SimpleNamespace

    from kvtide.restore.profile import LatencyProfile

    llm, store, ids, _, keys = stored
    L = llm.engine.model.args.num_layers
    eng = llm.engine
    for js, overlapped in (([0] * L, False), ([CHUNK] * L, True)):
        prof = LatencyProfile()
        seq = Sequence(f"o{time.perf_counter_ns()}", None, list(ids), greedy(1))
        assert eng.block_manager.allocate(seq, len(ids))
        with torch.inference_mode():
            res = RestoreExecutor(EnginePort(eng.runner, [seq]), store, CHUNK).run(
                [RestoreJob(ids, 0, N, len(ids), keys, js)], profile=prof)
        eng.block_manager.release(seq)
        assert res.load_bytes > 0 and (res.recompute_seconds > 0) == overlapped
        assert (prof.overlap_bandwidth is not None) == overlapped and (prof.solo_bandwidth is not None) != overlapped
    r = eng.restorer
    old = r.profile
    try:
        r.profile = LatencyProfile()
        r.profile.observe_load(4e9, 1.0)
        r.profile.observe_load(1e9, 1.0, overlapped=True)
        assert r.bandwidth("load") == pytest.approx(4e9) and r.bandwidth("cacheflow") == pytest.approx(1e9)
        picked = [(SimpleNamespace(num_tokens=N + 4), 0, N, [])]
        r.plan_for(picked, "cake")
        assert r.plan_bandwidth == pytest.approx(1e9)
        r.plan_for(picked, "load")
        assert r.plan_bandwidth == pytest.approx(4e9)
    finally:
        r.profile = old


def test_chunk_runs_group_only_whole_consecutive_chunks_of_one_layer_and_request() -> None:
    from kvtide.restore.executor import _chunk_runs

    C, S = 32, 1024
    items = [(0, (0, 0, 0, 32)), (0, (0, 1, 32, 64)), (0, (0, 2, 64, 96)),  # one run of 3
             (0, (1, 0, 0, 32)),  # another request
             (1, (1, 1, 32, 64)),  # another layer, and not chunk 0 of it: starts a new run
             (1, (1, 2, 64, 96)),
             (1, (1, 4, 128, 160)),  # a gap in chunk indices
             (2, (0, 0, 16, 32)),  # a partial chunk never joins
             (2, (0, 1, 32, 64))]
    shapes = [(2, C, 3, 64)] * len(items)
    offs = [k * S for k in range(len(items) + 1)]
    assert _chunk_runs(items, shapes, offs, [S] * len(items), C) == [(0, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9)]
    padded = [0, S + 64, 2 * S + 128]  # staging slots not back to back: no run
    assert _chunk_runs(items[:2], shapes[:2], padded, [S, S], C) == [(0, 1), (1, 2)]


def test_write_kv_chunks_places_what_per_entry_writes_place(stored) -> None:
    llm, _, ids, _, _ = stored
    eng = llm.engine
    runner = eng.runner
    heads, dim = EnginePort(runner, []).kv_entry_shape()
    chunks = torch.randn(3, 2, CHUNK, heads, dim).to(runner.kv_caches[0].dtype)
    got = []
    for grouped in (False, True):
        seq = Sequence(f"w{time.perf_counter_ns()}", None, list(ids), greedy(1))
        assert eng.block_manager.allocate(seq, len(ids))
        port = EnginePort(runner, [seq])
        if grouped:
            port.write_kv_chunks(2, 0, 0, chunks)
        else:
            for i in range(3):
                port.write_kv(2, 0, CHUNK * i, chunks[i])
        pages = torch.tensor(seq.pages)[:3 * CHUNK // runner.page_size]
        got.append(runner.kv_caches[2][pages].clone())
        eng.block_manager.release(seq)
    assert torch.equal(got[0], got[1])
    want = chunks.unflatten(2, (CHUNK // runner.page_size, runner.page_size)).transpose(1, 2).flatten(0, 1)
    assert torch.equal(got[1], want)


@pytest.mark.parametrize("stair", ["load-only", "staircase"])
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_store_loads_place_the_prefill_bytes_and_release_every_record(stored, stair: str,
                                                                             workers: int) -> None:
    """Zero-copy views of the pinned tier's slabs (ordinary memory here): the same bytes land, behind a link too,
    and every lease is given back once the restoration ends (a leak would pin records forever)."""
    from kvtide.store import PinnedMemoryStore

    llm, store, ids, want, keys = stored
    L = llm.engine.model.args.num_layers
    pinned = PinnedMemoryStore.filled_from(store, 64 << 20, slab_bytes=1 << 20)
    js = [0] * L if stair == "load-only" else [min(2, max(0, 2 - i)) * CHUNK for i in range(L)]
    for tier in (pinned, BandwidthLimitedStore(pinned, TokenBucket(1e10))):
        res, got = _run(llm, tier, ids, keys, js, LoadConfig(workers=workers))
        assert res.failures == [] and res.loaded_entries == sum(N // CHUNK - j // CHUNK for j in js)
        assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
        assert pinned.leased == 0


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2"])
def test_load_read_ahead_must_be_a_count(bad) -> None:
    from kvtide.config import RestoreConfig

    with pytest.raises(ValueError, match="load_read_ahead"):
        RestoreConfig(load_read_ahead=bad)
    with pytest.raises(ValueError, match="read_ahead"):
        LoadConfig(read_ahead=bad)
    assert RestoreConfig(load_read_ahead=0).load_read_ahead == 0
    assert LoadConfig().resolved_read_ahead(torch.device("cpu")) == 1
    assert LoadConfig().resolved_read_ahead(torch.device("cuda")) == 2
    assert LoadConfig(read_ahead=3).resolved_read_ahead(torch.device("cuda")) == 3


def test_restore_config_read_ahead_reaches_the_executor(monkeypatch) -> None:
    """``RestoreConfig.load_read_ahead`` is what the engine's restorations load with, and they stay token-exact."""
    import kvtide.engine.restoration as restoration
    from tests.restore.restore_helpers import two_turns

    llm = restore_llm()
    fresh_store(llm)
    b, ref = two_turns(llm, 9000, first=100, extra=12, out=2)
    seen: list[LoadConfig] = []

    class Spy(RestoreExecutor):
        def __init__(self, port, store, chunk, load, **kw) -> None:  # noqa: ANN001, ANN003
            seen.append(load)
            super().__init__(port, store, chunk, load, **kw)

    monkeypatch.setattr(restoration, "RestoreExecutor", Spy)
    monkeypatch.setattr(llm.engine.restorer.cfg, "load_read_ahead", 3)
    assert llm.generate(b, greedy(2))[0].token_ids == ref
    assert seen and all(load.read_ahead == 3 for load in seen)
