"""Device-wise CacheFlow restoration on a real pipeline (CPU, gloo, 2 shard processes, SmolLM2-135M):
greedy tokens after restoration equal a full prefill's (and the single-process engine's); a missing or corrupt
boundary activation falls back to the upstream shard's rows and is counted; plus the pure planning logic."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvtide.parallel.boundary import (
    boundary_key,
    iter_boundaries,
    load_boundary,
    save_boundary,
)
from kvtide.parallel.pipeline import PipelineConfig, launch
from kvtide.restore.costs import AnalyticReplayTime, BlockCost, RestoreRequest
from kvtide.restore.devicewise import (
    Route,
    ShardStatus,
    Source,
    a2_upper_bound,
    boundary_seconds,
    pipeline_estimate,
    plan_shard,
    resolve_routes,
    shard_cost,
    shard_ranges,
    split_rows,
    upstream_rows,
)
from kvtide.restore.planner import evaluate, plan
from kvtide.store import ChunkCorrupt, KeySpace, MemoryStore, TokenMismatch, chunk_keys
from kvtide.store.bandwidth import BandwidthLimitedStore, TokenBucket
from kvtide.store.base import StoreError
from tests.restore.devicewise_helpers import scenarios, single_shard

MODEL = "smollm2-135m"
N_OUT = 3


# ---- the pipeline (one launch for every end-to-end case: starting the processes is the slow part) ------------


def _text(offset: int, n: int) -> list[int]:
    from pydoc_data.topics import topics

    from kvtide.models.loader import resolve_model_dir
    from kvtide.models.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(MODEL, progress=False))
    return tok.encode(" ".join(topics[k] for k in sorted(topics)))[offset:offset + n]


@pytest.fixture(scope="module")
def runs() -> dict:
    from tests.conftest import require_model

    require_model(MODEL)
    convs = [(_text(0, 140), _text(3000, 20)), (_text(1000, 110), _text(5000, 30))]
    cfg = PipelineConfig(model=MODEL, num_shards=2, chunk_tokens=32, max_model_len=256, max_batch=2,
                         memory_bytes=64 << 20, timeout_s=120)
    return launch(cfg, scenarios, convs, N_OUT)


def _same(runs: dict, name: str, ref: str = "ref") -> dict:
    r = runs[name]
    assert r["tokens"] == runs[ref]["tokens"], f"{name}: {r['tokens']} != {runs[ref]['tokens']}"
    assert all(c > 0 for c in r["cached"]), f"{name}: nothing was restored"
    return r


def test_pipeline_prefill_equals_single_process_engine(runs):
    """The 2-shard pipeline computes what the single-process kvtide engine computes (same greedy tokens)."""
    from kvtide import CacheConfig, SamplingParams
    from kvtide.engine.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(MODEL, progress=False, cache=CacheConfig(num_pages=48, enable_prefix_caching=False))
    ref = llm.generate(runs["turn2"][0], SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True))[0]
    assert ref.token_ids == runs["ref"]["tokens"][0]


def test_devicewise_restoration_equals_full_prefill(runs):
    for name in ("dw_recompute", "dw_cacheflow", "dw_cake"):
        r = _same(runs, name)
        assert len(r["records"]) == 2 and all(rec["devicewise"] for rec in r["records"])
        assert all(rec["boundary_fallbacks"] == 0 and rec["upstream_rows"] == 0 for rec in r["records"])
    # Recompute plan: the downstream shard replayed the whole prefix from its boundary activation, at once.
    down = runs["dw_recompute"]["records"][1]
    n = runs["dw_recompute"]["cached"][0]
    assert down["boundaries"] == [[n] * 15] and down["boundary_bytes"] > 0
    # Throttled link: each shard planned its own layers (its own DP, profile and link).
    assert all(rec["predicted_seconds"] > 0 for rec in runs["dw_cacheflow"]["records"])


def test_devicewise_batch_of_two(runs):
    _same(runs, "dw_batch", ref="ref_batch")
    assert len(runs["dw_batch"]["records"][0]["boundaries"]) == 2


def test_shard0_does_not_wait_for_downstream_boundary_reads(runs):
    """Shard 0 replays from the embeddings: it starts while shard 1 is still reading its boundary rows over a
    slow link (it used to wait for every shard's boundary reads in a collective before starting)."""
    r = _same(runs, "dw_slow_boundary")
    up, down = r["records"]
    assert down["boundary_bytes"] > 0 and down["boundary_seconds"] > 0.1  # ~0.15 s at 20 Mbps
    start0 = up["t0"] + up["timeline"]["exec"]
    rows1 = down["t0"] + down["timeline"]["boundary"]
    assert start0 < rows1 - 0.08, (start0, rows1)
    # and the downstream shard's executor starts once its rows are on the device
    assert down["timeline"]["exec"] >= down["timeline"]["boundary"]
    assert down["predicted_boundary_seconds"] > 0 and up["predicted_boundary_seconds"] == 0


def test_sequential_layout_waits_for_upstream(runs):
    """One staircase over all layers (no boundary activations): the downstream shard takes upstream's rows."""
    for name in ("seq_cacheflow", "seq_recompute"):
        _same(runs, name)
    down = runs["seq_recompute"]["records"][1]
    assert down["upstream_rows"] == runs["seq_recompute"]["cached"][0] and down["boundary_bytes"] == 0
    assert down["boundary_fallbacks"] == 0  # not a fallback: this layout has no boundary activations


@pytest.mark.parametrize("case", ["missing", "corrupt"])
def test_bad_boundary_falls_back_to_upstream(runs, case):
    r = _same(runs, case)
    up, down = r["records"]
    assert down["boundary_fallbacks"] == 1 and up["boundary_fallbacks"] == 0
    # recompute plan: upstream's last layer replays the whole prefix, the downstream takes all of it
    assert down["upstream_rows"] == r["cached"][0] and down["poisoned"] == 0


def test_fallbacks_counted_and_repaired(runs):
    before, after = runs["stats_before"][1], runs["stats_after"][1]
    assert after["boundary_fallbacks"] - before["boundary_fallbacks"] == 2
    assert after["store"]["misses"] > before["store"]["misses"]
    assert after["store"]["corrupt"] > before["store"]["corrupt"]
    # save after the corrupt case rewrote the damaged entries from the rows upstream sent: no fallback after
    r = _same(runs, "repaired")
    assert r["records"][1]["boundary_fallbacks"] == 0 and r["records"][1]["upstream_rows"] == 0


def test_lost_kv_entry_and_double_failure(runs):
    r = _same(runs, "kv_missing")  # executor fallback, later boundary rows fetched on demand
    assert r["records"][1]["kv_fallback_requests"] == 1 and r["records"][1]["poisoned"] == 0
    r = _same(runs, "double")  # no boundary row either: the request is recomputed through the whole pipeline
    assert r["records"][1]["poisoned"] == 1 and r["records"][0]["poisoned"] == 1
    assert runs["stats_after"][0]["poisoned"] == 1


# ---- pure logic (no processes) ------------------------------------------------------------------------------------


def test_shard_ranges_and_split():
    assert shard_ranges(30, 2) == [range(0, 15), range(15, 30)]
    assert shard_ranges(32, 3) == [range(0, 11), range(11, 22), range(22, 32)]
    with pytest.raises(ValueError):
        shard_ranges(2, 3)
    assert split_rows([[9, 8, 7, 6]], shard_ranges(4, 2)) == [[[9, 8]], [[7, 6]]]


def test_routes_cap_chain_and_sources():
    ok = ShardStatus
    # shard 1 lost its boundary: capped at shard 0's last (64); shard 2 too: capped at shard 1's capped last
    st = [[ok(128, 64, True)], [ok(128, 96, False)], [ok(96, 32, False)], [ok(64, 0, True)]]
    routes = resolve_routes(st, devicewise=True)
    assert [r[0].source for r in routes] == [Source.EMBED, Source.UPSTREAM, Source.UPSTREAM, Source.BOUNDARY]
    assert (routes[1][0].cap, routes[1][0].first, routes[1][0].last) == (64, 64, 64)
    assert (routes[2][0].cap, routes[2][0].first, routes[2][0].last) == (64, 64, 32)
    assert routes[1][0].apply([128, 96, 64, 32]) == [64, 64, 64, 32]
    assert [r[0].fallback for r in routes] == [False, True, True, False]
    assert upstream_rows(routes, 0) == [64] and upstream_rows(routes, 1) == [64] and upstream_rows(routes, 2) == [0]
    # a shard that replays nothing needs no boundary activation: no fallback
    idle = resolve_routes([[ok(64, 0, True)], [ok(0, 0, False)]], True)[1][0]
    assert idle == Route(Source.BOUNDARY, None, 0, 0, False)
    # sequential layout: every downstream shard reads upstream, nothing is capped or counted
    seq = resolve_routes([[ok(128, 96, True)], [ok(96, 64, False)]], devicewise=False)
    assert seq[1][0] == Route(Source.UPSTREAM, 96, 96, 64, False)
    with pytest.raises(ValueError):
        resolve_routes([[ok(64, 32, True)], [ok(96, 0, False)]], devicewise=False)  # not one staircase
    with pytest.raises(ValueError):
        ShardStatus(32, 64, True)


def test_boundary_records_are_checked():
    space = KeySpace("m", 4)
    toks = [1, 2, 3, 4]
    key = chunk_keys(toks, space)[0]
    store = MemoryStore(1 << 20, drop_bad=False)  # keep failed entries: several checks on one
    h = torch.randn(4, 6)
    save_boundary(store, key, 3, toks, h)
    back, nbytes = load_boundary(store, key, 3, toks, 6, torch.float32)
    assert torch.equal(back, h) and nbytes > h.numel() * 4
    assert boundary_key(key, 3) != key and boundary_key(key, 3) != boundary_key(key, 4)
    assert not store.contains(key, 3)  # its own namespace: never read as KV
    with pytest.raises(TokenMismatch):
        load_boundary(store, key, 3, [1, 2, 3, 5], 6, torch.float32)
    name = boundary_key(key, 3).entry_name(3)
    blob = bytearray(store._read(name))
    blob[-3] ^= 1
    store._poke(name, bytes(blob))
    with pytest.raises(ChunkCorrupt):
        load_boundary(store, key, 3, toks, 6, torch.float32)


def test_per_shard_plans_scale_near_linearly():
    """Appendix A.2 on the planner itself (Llama-3.1-8B-like costs, 10 Gbps per device): each shard's own DP
    objective lies between T*_single / S and T*_single / S + max(F(N), sN/B) + L sigma / S."""
    F = AnalyticReplayTime(overhead=1e-4, per_token=4e-6, per_token_sq=1e-10)
    full = BlockCost(32, 4096.0, 0.0, F)
    B, C = 1.25e9, 512
    for n, ns in ((16384, 0), (32768, 512)):
        reqs = [RestoreRequest(n, ns)]
        t1 = plan(reqs, full, B, C).predicted_seconds
        sigma = float(F(n + ns) - F(n))
        for S in (2, 4):
            ts = [plan(reqs, shard_cost(full, rg), B, C).predicted_seconds for rg in shard_ranges(32, S)]
            bound = a2_upper_bound(t1, S, float(F(n)), 4096.0 * n / B, 32 * sigma)
            assert t1 / S - 1e-9 <= max(ts) <= bound, (n, S, t1, ts, bound)
            est = pipeline_estimate(ts, sigma, [len(rg) for rg in shard_ranges(32, S)])
            assert est <= bound + 32 * sigma and est < t1


def test_config_fails_fast():
    for bad in (dict(num_shards=0), dict(device="tpu"), dict(kv_dtype="int8"), dict(chunk_tokens=0),
                dict(method="nope"), dict(bandwidth_gbps=0.0), dict(store="ftp://x"), dict(max_model_len=10)):
        with pytest.raises(ValueError):
            PipelineConfig(**bad)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="needs a machine with fewer than 4 GPUs")
def test_launch_refuses_missing_gpus():
    with pytest.raises(RuntimeError, match="need 4 GPUs"):
        launch(PipelineConfig(device="cuda", num_shards=4), scenarios)


# ---- S = 1: device-wise and the single-device plan are one plan and one execution --------------------------------


def test_single_shard_devicewise_is_the_single_device_plan():
    """With one shard there is no boundary: device-wise CacheFlow must plan and run exactly what the single-device
    plan does (same inputs: a frozen profile, the same store), so any TTFT gap between them at S = 1 is not the
    method's (the H200 run's 1.7x gap at S = 1 was the benchmark's order: device-wise always ran each new request
    shape first)."""
    from tests.conftest import require_model

    require_model(MODEL)
    cfg = PipelineConfig(model=MODEL, num_shards=1, chunk_tokens=32, max_model_len=256, max_batch=1,
                         memory_bytes=64 << 20, timeout_s=120)
    out = launch(cfg, single_shard, _text(0, 170), N_OUT)
    dw, seq = out["dw"], out["seq"]
    assert dw["tokens"] == seq["tokens"] and dw["cached"] == seq["cached"] and dw["cached"][0] > 0
    (a,), (b,) = dw["records"], seq["records"]
    assert a["boundaries"] == b["boundaries"]
    assert a["predicted_seconds"] == pytest.approx(b["predicted_seconds"], rel=1e-9)
    assert a["boundary_bytes"] == b["boundary_bytes"] == 0 and a["predicted_boundary_seconds"] == 0
    assert a["upstream_rows"] == b["upstream_rows"] == 0
    assert a["load_bytes"] == b["load_bytes"]


# ---- boundary rows at the link's rate --------------------------------------------------------------------------------


class _SlowChecks:
    """A tier whose record checks take ``delay`` seconds each (as the checksum + copy + host-to-device of a 4 MB boundary
    record take about as long as its 3.4 ms on a 10 Gbps link on the H200 host)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def open(self, *a, **kw):
        time.sleep(self.delay)
        return self.inner.open(*a, **kw)

    def get_entry(self, *a):
        time.sleep(self.delay)
        return self.inner.get_entry(*a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _EntryByEntry:
    """Only ``get_entry``: how boundary rows used to be read (one record after the other)."""

    def __init__(self, inner) -> None:
        self.get_entry = inner.get_entry


def _boundary_store(n_chunks: int, tokens: int, hidden: int):
    space = KeySpace("m", tokens)
    toks = list(range(n_chunks * tokens))
    keys = chunk_keys(toks, space)
    mem = MemoryStore(64 << 20)
    hs = [torch.randn(tokens, hidden) for _ in keys]
    size = sum(save_boundary(mem, k, 5, toks[i * tokens:(i + 1) * tokens], h) for i, (k, h) in enumerate(zip(keys, hs)))
    items = [(k, toks[i * tokens:(i + 1) * tokens]) for i, k in enumerate(keys)]
    return mem, items, hs, size


def test_boundary_rows_load_at_the_link_rate():
    """Every chunk is booked on the link at once and checked while later ones travel: the link never idles, so
    8 records whose checks cost as much as their transfer take ~1x the link time, not ~2x (what reading entry
    by entry did: each record waited out the link only after it had been read and checked)."""
    n, delay = 8, 0.025
    mem, items, hs, size = _boundary_store(n, 64, 512)
    rate = size / (n * delay)  # link time of the whole read: n * delay = 0.2 s

    def run(batched: bool) -> float:
        store = BandwidthLimitedStore(_SlowChecks(mem, delay), TokenBucket(rate))
        store = store if batched else _EntryByEntry(store)
        t = time.perf_counter()
        got = list(iter_boundaries(store, items, 5, 512, torch.float32, batch_bytes=1))
        dt = time.perf_counter() - t
        assert [i for i, _, _ in got] == list(range(n))
        assert all(torch.equal(h, hs[i]) for i, h, _ in got) and sum(nb for *_, nb in got) == size
        return dt

    pipelined, entry_by_entry = run(True), run(False)
    assert pipelined < n * delay + 2.5 * delay, pipelined  # link time + the last record's check (+ slack)
    assert entry_by_entry > 1.6 * n * delay, entry_by_entry  # the old way, for contrast


def test_boundary_rows_report_each_failure():
    mem, items, hs, _ = _boundary_store(4, 16, 8)
    mem.delete(boundary_key(items[1][0], 5), 5)
    name = boundary_key(items[2][0], 5).entry_name(5)
    blob = bytearray(mem._read(name))
    blob[-3] ^= 1
    mem._poke(name, bytes(blob))
    got = {i: h for i, h, _ in iter_boundaries(mem, items, 5, 8, torch.float32)}
    assert torch.equal(got[0], hs[0]) and torch.equal(got[3], hs[3])
    assert isinstance(got[1], StoreError) and isinstance(got[2], ChunkCorrupt)


# ---- the boundary in the shard's plan ------------------------------------------------------------------------------


def _brute(req: RestoreRequest, cost: BlockCost, B: float, C: int, h: float) -> float:
    """min over every staircase on the chunk grid of h j_0 / B + T (small cases only)."""
    import itertools

    K, L = req.cached_tokens // C, cost.num_blocks
    best = np.inf
    for levels in itertools.combinations_with_replacement(range(K, -1, -1), L):
        J = [c * C for c in levels]
        best = min(best, evaluate([req], [J], cost, B, C).total_seconds + h * J[0] / B)
    return float(best)


def test_shard_plan_counts_its_boundary_rows():
    """A downstream shard reads its first layer's replay rows before anything else (h bytes a token on its own
    link): the plan's objective includes h j_0 / B and the staircase is the best one under that objective, not
    the boundary-blind plan with the rows added afterwards."""
    F = AnalyticReplayTime(overhead=2e-4, per_token=0.9e-6, per_token_sq=1e-11)  # ~ an H200 layer of Llama-3.1-8B
    C, B, s = 512, 1.25e9, 4100.0
    h = 2 * s  # Llama-3.1-8B: a token's hidden state (bf16) is as large as two layers' KV
    for n, ns, L in ((7680, 6476, 16), (3584, 1439, 16), (16384, 64, 16), (4096, 512, 4)):
        req, cost = RestoreRequest(n, ns), BlockCost(L, s, 0.0, F)
        blind = plan([req], cost, B, C)
        p = plan_shard("cacheflow", [req], cost, B, C, h)
        got = evaluate([req], p.boundaries, cost, B, C).total_seconds + boundary_seconds(p.boundaries, h, B)
        assert p.predicted_seconds == pytest.approx(got, rel=1e-9)
        assert p.predicted_seconds <= blind.predicted_seconds + boundary_seconds(blind.boundaries, h, B) + 1e-12
        if L <= 4:
            assert p.predicted_seconds == pytest.approx(_brute(req, cost, B, C, h), rel=1e-9)
    # here a lower top boundary (fewer boundary rows, more loads) is strictly better
    req, cost = RestoreRequest(3584, 1439), BlockCost(16, s, 0.0, F)
    blind = plan([req], cost, B, C)
    p = plan_shard("cacheflow", [req], cost, B, C, h)
    assert p.boundaries[0][0] < blind.boundaries[0][0]
    # shard 0 (no boundary) and the baselines plan exactly as before
    assert plan_shard("cacheflow", [req], cost, B, C).boundaries == blind.boundaries
    cake = plan_shard("cake", [req], cost, B, C, h)
    assert cake.boundaries == plan_shard("cake", [req], cost, B, C).boundaries


def _brute_decode(req: RestoreRequest, L: int, s: float, t: float, F, B: float, C: int, h: float,
                  scale: float = 1.0) -> float:
    """min over every staircase on the chunk grid of h j_0 / B + max(P + L sig, sum (s/B + t)(N - j) + sig), the
    decode t of each loaded token written out (small cases only)."""
    import itertools

    n, K = req.cached_tokens, req.cached_tokens // C
    sig = scale * float(F(n + req.suffix_tokens) - F(n))
    best = np.inf
    for levels in itertools.combinations_with_replacement(range(K, -1, -1), L):
        J = [c * C for c in levels]
        P = sum(float(F(j)) for j in J)
        load = sum((s / B + t) * (n - j) for j in J)
        best = min(best, max(P + L * sig, load + sig) + h * J[0] / B)
    return float(best)


def test_shard_plans_charge_the_profile_decode():
    """Entries under a KVServe profile decode on the load path (t seconds a loaded token): a shard's plan, with and
    without boundary rows, is the best staircase under that cost, checked against brute force with t written out.
    ``shard_cost`` keeps t (and the suffix scale) for the shard's blocks; the boundary search prices loads at
    s + t B."""
    F = AnalyticReplayTime(overhead=2e-4, per_token=0.9e-6, per_token_sq=1e-11)
    C, B, s = 512, 1.25e9, 1024.0  # a 4x-compressed entry of ~4 KiB a token
    found_shift = False
    for n, ns, L, t, scale in ((4096, 512, 4, 2e-6, 1.0), (3584, 1439, 4, 4e-6, 0.7), (2048, 64, 3, 1e-6, 1.0),
                               (4096, 2048, 4, 8e-6, 0.5), (1024, 8000, 3, 4e-6, 0.2)):
        full = BlockCost(2 * L, s, 0.0, F, suffix_scale=scale, decode_seconds_per_token=t)
        cost = shard_cost(full, shard_ranges(2 * L, 2)[1])
        assert (cost.num_blocks, cost.decode_seconds_per_token, cost.suffix_scale) == (L, t, scale)
        req = RestoreRequest(n, ns)
        for h in (0.0, 2 * 4096.0):
            p = plan_shard("cacheflow", [req], cost, B, C, h)
            want = _brute_decode(req, L, s, t, F, B, C, h, scale)
            assert p.predicted_seconds == pytest.approx(want, rel=1e-9), (n, ns, L, t, h, p.boundaries)
        # the decode moves the plan: without it the same shard loads more
        free = plan_shard("cacheflow", [req], dataclasses.replace(cost, decode_seconds_per_token=0.0), B, C, h)
        found_shift |= sum(free.boundaries[0]) < sum(p.boundaries[0])
    assert found_shift


def test_suffix_attention_after_a_prefix_is_causal_bottom_right():
    """The rows after a prefix attend over [0, end) causally: the FlashAttention path (bottom-right causal, K/V
    heads expanded) computes what the boolean mask computes (run on the CPU through the same code)."""
    from kvtide.parallel.shard import SlotAttention, SlotKV

    torch.manual_seed(0)
    kv = SlotKV(1, 1, 64, 2, 16, torch.float32, torch.device("cpu"))
    att = SlotAttention(kv, 0, 16)
    q, k, v = torch.randn(40, 8, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    att.plan([(0, 0, 40)])
    full = att(0, q, k, v)
    att.plan([(0, 0, 24)])
    att(0, q[:24], k[:24], v[:24])
    att.plan([(0, 24, 40)])
    tail = att(0, q[24:], k[24:], v[24:])
    qq = q[24:].transpose(0, 1)[None]
    kk, vv = (kv.layers[0][0, i, :40].transpose(0, 1)[None] for i in (0, 1))
    lr = att._lower_right(qq, kk, vv, 16, 40)[0].transpose(0, 1)
    assert torch.allclose(tail, full[24:], atol=1e-5) and torch.allclose(lr, tail, atol=1e-5)
