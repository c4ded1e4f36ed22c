"""Prometheus metrics of `kvtide serve`, named as vLLM names them (prefix ``kvtide:``) so dashboards carry over.

Request metrics (tokens, finishes, latency histograms) are observed per engine output in the engine's driver
thread, where each output is delivered. Engine state (running / waiting requests, KV usage, prefix-cache and
restoration counters) is read there too, after a step, into an immutable `EngineSnapshot` that a scrape only reads:
the HTTP threads never touch the engine's structures. A snapshot is taken at most every ``SNAPSHOT_INTERVAL_S``
and after every finished or aborted request, so an idle engine always shows its final state.

``request_queue_time_seconds`` is the time from arrival to the first step that took the request in (its prefill's
first chunk or its restoration), as the scheduler records it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from ..log import get_logger, warn_limited

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine, RequestOutput

log = get_logger("server")

PREFIX = "kvtide:"
SNAPSHOT_INTERVAL_S = 0.1
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that histograms compare bucket by bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# store counters that mean a restore fell back to recompute (a lookup miss is not one)
STORE_FALLBACKS = ("corrupt", "truncated", "token_mismatch", "forged", "oversize", "read_errors", "unavailable")


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0  # includes the restoring ones: they wait for their KV (as vLLM counts remote-KV waits)
    restoring: int = 0  # admitted by a restoration in flight: pages held, prompt KV still loading/recomputing
    kv_usage: float = 0.0  # fraction of the KV cache held by requests (prefix-cached free pages are free)
    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    external_hit_tokens: int = 0  # prompt tokens restored from a KV store
    compression_ratio: float = 1.0  # raw / stored bytes of the compressed pages held (1: no compression)
    restore_method: str | None = None
    restorations: int = 0  # requests restored
    profile_restorations: int = 0  # of those, restored from entries stored under a KVServe profile
    fallbacks: dict[str, int] = field(default_factory=dict)
    store_bytes_loaded: int = 0
    store_bytes_written: int = 0


@dataclass
class Track:
    """One engine request's timing, touched only in the driver thread."""

    last: float | None = None  # when its previous output was delivered
    prompt_counted: bool = False


class ServerMetrics:
    def __init__(self, engine: "LLMEngine", model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that started.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first token.", labels,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.", labels,
                             buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to the first step that took "
                                    "the request in.", labels, buckets=LATENCY_BUCKETS,
                                    registry=reg).labels(model_name)
        reg.register(_EngineCollector(self))
        ProcessCollector(registry=reg)
        self.snapshot = EngineSnapshot()
        self._snapshot_at = 0.0
        self.totals = {"prompt": 0, "generation": 0}  # plain copies of the counters, for the log line
        self._lock = threading.Lock()  # guards totals (driver thread writes, the log task reads)
        self._logged = (time.monotonic(), 0, 0, 0, 0)  # (time, prompt, generation, prefix queries, prefix hits)

    # ---- driver thread ----------------------------------------------------------------------------------------
    def observe(self, track: Track, out: "RequestOutput") -> None:
        """Count one output of an engine request (called where the output is delivered)."""
        now = time.perf_counter()
        try:
            self._observe(track, out, now)
            if out.finished or now - self._snapshot_at >= SNAPSHOT_INTERVAL_S:
                self.snapshot = self.take_snapshot()
                self._snapshot_at = now
        except Exception as e:  # noqa: BLE001 - metrics never fail a request
            warn_limited(log, "metrics-observe", "observing an output for the metrics failed: %s: %s",
                         type(e).__name__, e)

    def _observe(self, track: Track, out: "RequestOutput", now: float) -> None:
        n = len(out.new_token_ids)
        if n and not track.prompt_counted:
            track.prompt_counted = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            with self._lock:
                self.totals["prompt"] += len(out.prompt_token_ids)
            if out.ttft is not None:
                self.ttft.observe(out.ttft)
            if out.queue_time is not None:
                self.queue_time.observe(out.queue_time)
        elif n and track.last is not None:
            for _ in range(n):
                self.itl.observe((now - track.last) / n)
        if n:
            track.last = now
            self.generation_tokens.inc(n)
            with self._lock:
                self.totals["generation"] += n
        if out.finished:
            self.request_success.labels(self.model_name, out.finish_reason or "unknown").inc()
            if out.latency is not None:
                self.e2e.observe(out.latency)

    def take_snapshot(self) -> EngineSnapshot:
        eng = self.engine
        sch, bm = eng.scheduler, eng.block_manager
        store = eng.pool  # the compressed page pool (None: the fixed cache)
        if store is None:
            usage = 1.0 - len(bm.free) / bm.num_pages if bm.num_pages else 0.0
            ratio = 1.0
        else:
            cap = store.raw_capacity_pages
            usage = 1.0 - store.free_pages(reserve=False) / cap if cap else 0.0
            c = store.counters
            raw, stored = c["k_raw_bytes"] + c["v_raw_bytes"], c["k_stored_bytes"] + c["v_stored_bytes"]
            ratio = raw / stored if raw and stored else 1.0
        snap: dict[str, Any] = dict(
            running=len(sch.running), waiting=len(sch.waiting) + len(sch.restoring), restoring=len(sch.restoring),
            kv_usage=min(1.0, max(0.0, usage)),
            preemptions=sch.num_preemptions, prefix_query_tokens=bm.stats["prefix_query_tokens"],
            prefix_hit_tokens=bm.stats["prefix_hit_tokens"], compression_ratio=ratio)
        if eng.restorer is not None:
            snap.update(self._restore_figures(eng.restorer))
        return EngineSnapshot(**snap)

    @staticmethod
    def _restore_figures(restorer: Any) -> dict[str, Any]:
        rs = restorer.stats
        fallbacks = {"load_failed": rs.fallbacks, "error": rs.errors, "lookup_failed": rs.lookup_failures,
                     "lookup_deferred": rs.lookups_deferred}
        out: dict[str, Any] = dict(restore_method=restorer.cfg.method, restorations=rs.requests,
                                   profile_restorations=rs.profile_requests,
                                   external_hit_tokens=rs.restored_tokens)
        try:
            counts = restorer.store.stats.snapshot()
            fallbacks.update({name: counts.get(name, 0) for name in STORE_FALLBACKS})
            out.update(store_bytes_loaded=counts.get("bytes_read", 0),
                       store_bytes_written=counts.get("bytes_written", 0))
        except Exception as e:  # noqa: BLE001 - a store without these counters: the restore figures still count
            warn_limited(log, "metrics-store", "reading the KV store's counters failed: %s: %s", type(e).__name__, e)
        out["fallbacks"] = fallbacks
        return out

    # ---- the periodic log line (any thread) --------------------------------------------------------------------
    def log_line(self) -> str | None:
        """Throughput since the previous line, and the engine's state; None when nothing happened since."""
        now = time.monotonic()
        s = self.snapshot
        with self._lock:
            prompt, gen = self.totals["prompt"], self.totals["generation"]
        t0, p0, g0, q0, h0 = self._logged
        if prompt == p0 and gen == g0 and not s.running and not s.waiting:
            return None
        self._logged = (now, prompt, gen, s.prefix_query_tokens, s.prefix_hit_tokens)
        dt = max(now - t0, 1e-9)
        queries = s.prefix_query_tokens - q0
        hit = 100.0 * (s.prefix_hit_tokens - h0) / queries if queries else 0.0
        line = (f"prompt throughput {(prompt - p0) / dt:.1f} tokens/s, generation throughput {(gen - g0) / dt:.1f} "
                f"tokens/s, running {s.running} reqs, waiting {s.waiting} reqs, KV cache usage "
                f"{100 * s.kv_usage:.1f}%, prefix cache hit rate {hit:.1f}%")
        if s.compression_ratio != 1.0:
            line += f", KV compression {s.compression_ratio:.2f}x"
        if s.restore_method is not None:
            line += f", restored {s.restorations} reqs ({s.external_hit_tokens} tokens)"
        return line


class _EngineCollector:
    """The engine's gauges and counters, from the latest snapshot."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s, model = self.metrics.snapshot, self.metrics.model_name

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to run (those being restored included).", s.waiting)
        yield gauge("num_requests_restoring", "Requests whose prompt KV a restoration is loading or recomputing.",
                    s.restoring)
        yield gauge("kv_cache_usage_perc", "Fraction of the KV cache held by requests (1 = full).", s.kv_usage)
        yield gauge("kv_compression_ratio", "Raw / stored bytes of the compressed KV pages held (1: none).",
                    s.compression_ratio)
        yield counter("num_preemptions", "Preempted requests.", s.preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens)
        yield counter("external_prefix_cache_hits", "Prompt tokens restored from a KV store.", s.external_hit_tokens)
        yield counter("store_bytes_loaded", "Bytes read from the KV store.", s.store_bytes_loaded)
        yield counter("profile_restorations", "Requests restored from KV store entries kept under a KVServe "
                      "profile (within their quality budget).", s.profile_restorations)
        yield counter("store_bytes_written", "Bytes written to the KV store.", s.store_bytes_written)
        r = CounterMetricFamily(PREFIX + "restorations", "Requests restored from a KV store, by method.",
                                labels=["model_name", "method"])
        if s.restore_method is not None:
            r.add_metric([model, s.restore_method], s.restorations)
        yield r
        f = CounterMetricFamily(PREFIX + "restore_fallbacks", "Restorations or store entries that fell back to "
                                "recompute, by reason.", labels=["model_name", "reason"])
        for reason, count in sorted(s.fallbacks.items()):
            f.add_metric([model, reason], count)
        yield f
