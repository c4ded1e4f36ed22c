"""The restoration and store metrics follow the engine's own counters (an engine with a KV store, no HTTP)."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtide import SamplingParams
from kvtide.config import RestoreConfig
from kvtide.server.metrics import ServerMetrics
from tests.conftest import engine_llm


def _samples(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_restored_tokens_restorations_and_store_bytes():
    llm = engine_llm("smollm2-135m", restore=RestoreConfig(store="memory", chunk_tokens=32, method="load"))
    eng = llm.engine
    metrics = ServerMetrics(eng, "m")
    prompt = "A long shared prefix about kv caches and restoration. " * 8
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt + "One", params)
    eng.block_manager.evict_cached()  # the device cache forgets it; the store keeps the chunks
    llm.generate(prompt + "Two", params)
    assert eng.restorer.writer.flush(timeout=30)
    rs, store = eng.restorer.stats, eng.restorer.store.stats.snapshot()
    assert rs.requests >= 1 and rs.restored_tokens >= 32 and store["bytes_read"] > 0
    metrics.snapshot = metrics.take_snapshot()
    s = _samples(metrics)
    m = (("model_name", "m"),)
    assert s[("kvtide:external_prefix_cache_hits_total", m)] == rs.restored_tokens
    assert s[("kvtide:restorations_total", (("method", "load"), ("model_name", "m")))] == rs.requests
    assert s[("kvtide:store_bytes_loaded_total", m)] == store["bytes_read"]
    assert s[("kvtide:store_bytes_written_total", m)] == store["bytes_written"] > 0
    fallbacks = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "kvtide:restore_fallbacks_total"}
    assert fallbacks["load_failed"] == rs.fallbacks and fallbacks["corrupt"] == store["corrupt"] == 0
    assert s[("kvtide:prefix_cache_queries_total", m)] == eng.block_manager.stats["prefix_query_tokens"]


def test_requests_being_restored_count_as_waiting_and_restoring():
    llm = engine_llm("smollm2-135m", restore=RestoreConfig(store="memory", chunk_tokens=32, method="load"))
    eng = llm.engine
    metrics = ServerMetrics(eng, "m")
    sch = eng.scheduler
    fake = [object(), object()]  # stand-ins: the snapshot only counts the scheduler's lists
    sch.restoring.extend(fake)
    try:
        metrics.snapshot = metrics.take_snapshot()
        s = _samples(metrics)
        m = (("model_name", "m"),)
        assert s[("kvtide:num_requests_restoring", m)] == 2
        assert s[("kvtide:num_requests_waiting", m)] == len(sch.waiting) + 2
        assert s[("kvtide:num_requests_running", m)] == len(sch.running)
    finally:
        for f in fake:
            sch.restoring.remove(f)
