"""Engine wiring of CacheFlow restoration: write finished prefixes to a KV store, restore them by plan.

* At finish, every full chunk (``chunk_tokens``) of a request's computed tokens (prompt + output) is copied out
  of its pages and written, one entry per layer, by a background writer. That also covers the device prefix
  cache's evictions: an evictable page belongs to a released sequence whose full chunks were written when it
  finished (only a preempted sequence's pages are not spilled; they are recomputed as before).
* Each step, before the normal scheduler, the waiting queue is checked in order: device prefix-cache hits
  first (kept up to the last whole chunk), then consecutive store chunks after them. Requests with at least
  one chunk to restore (up to ``max_batch`` of them, in queue order) are admitted with pages for their whole prompt,
  planned together (``method``: CacheFlow's DP or a baseline, same cost model), and run by the executor; each
  enters the running set with all its tokens computed and its first token sampled, and decodes normally.
* The latency profile F(t) learns from the prefills the engine runs anyway (single-request prefills from
  position 0) and from the executor's own per-layer recompute; load bandwidth from the executor's loads.
* A load that fails is recomputed by the executor (counted here and in the store's stats); an unexpected error
  in a restoration puts its requests back at the head of the queue as plain prefills (counted as ``errors``).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..restore.costs import BlockCost, RestoreRequest
from ..restore.executor import RestoreExecutor, RestoreJob, RestoreResult
from ..restore.methods import make_plan
from ..restore.planner import Plan
from ..restore.profile import LatencyProfile
from ..store.bandwidth import gbps
from ..store.base import HEADER_BYTES
from ..store.factory import open_store
from ..store.keys import ChunkKey, KeySpace, chunk_keys
from ..store.writer import StoreWriter
from .restore_port import EnginePort, read_chunk_kv
from .sampler import sample
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .llm_engine import LLMEngine, RequestOutput

META_BYTES_ESTIMATE = 140  # JSON metadata of one record (key, layer, dtype, shape, ...)
DEFAULT_BANDWIDTH = 2e9  # bytes/s guessed for an unthrottled in-process tier before any load is measured


@dataclass
class RestoreStats:
    restorations: int = 0  # batches run by the executor
    requests: int = 0
    restored_tokens: int = 0  # prefix tokens brought back (recomputed or loaded)
    recomputed_tokens: int = 0  # sum over (request, layer) of recomputed prefix tokens
    loaded_tokens: int = 0  # sum over (request, layer) of loaded prefix tokens
    load_failures: int = 0  # entries that failed to load (any cause)
    fallbacks: int = 0  # requests whose failed loads were recomputed
    fallback_tokens: int = 0
    errors: int = 0  # restorations abandoned for a plain prefill
    chunks_written: int = 0
    lookups: int = 0


@dataclass
class RestoreRecord:
    """One executed restoration, for the demo, the benchmark and debugging."""

    method: str
    cached: list[int]
    suffix: list[int]
    start: list[int]
    boundaries: list[list[int]]
    predicted_seconds: float
    predicted_compute_seconds: float
    predicted_load_seconds: float
    planning_seconds: float
    total_seconds: float
    recompute_seconds: float
    load_seconds: float
    wait_seconds: float
    suffix_seconds: float
    load_bytes: int
    bandwidth: float
    failures: int
    fallback_tokens: int
    request_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Restorer:
    def __init__(self, engine: "LLMEngine"):
        cfg = engine.config.restore
        assert cfg is not None
        self.engine = engine
        self.cfg = cfg
        a = engine.model.args
        self.num_layers = a.num_layers
        self.chunk = cfg.chunk_tokens
        self.store = open_store(cfg.store, cfg.memory_bytes, cfg.bandwidth_gbps)
        self.keyspace = KeySpace(f"{engine.config.model}|{a.num_layers}x{a.hidden_size}x{a.num_kv_heads}x{a.head_dim}",
                                 self.chunk, str(engine.config.cache.torch_kv_dtype).replace("torch.", ""))
        itemsize = engine.config.cache.torch_kv_dtype.itemsize
        record = HEADER_BYTES + META_BYTES_ESTIMATE + 4 * self.chunk + 2 * self.chunk * a.num_kv_heads * a.head_dim * itemsize
        self.bytes_per_token = record / self.chunk  # s: stored bytes per token per block (what loads move)
        self.profile = LatencyProfile()
        self.writer = StoreWriter(self.store) if cfg.write_on_finish else None
        self.stats = RestoreStats()
        self.history: deque[RestoreRecord] = deque(maxlen=256)
        self._known: OrderedDict[str, None] = OrderedDict()  # chunk keys written or restored lately
        self._no_restore: set[str] = set()  # request ids sent back to plain prefill

    def use_store(self, store: Any, writes: Any | None = None) -> None:
        """Switch to another store (benchmarks, tests) and forget what the old one held. Finished requests'
        chunks go to `writes` (default: the same store; a bench writes past its emulated link)."""
        if self.writer is not None:
            self.writer.close()
        self.writer = StoreWriter(writes if writes is not None else store) if self.cfg.write_on_finish else None
        self.store = store
        self._known.clear()
        self._no_restore.clear()

    # ---- bookkeeping hooks called by the engine ------------------------------------------------------
    def observe_step(self, batch: list[tuple[Sequence, int]], seconds: float) -> None:
        """F(t) from the prefills the engine runs anyway: one sequence, from position 0, t tokens, L blocks."""
        if len(batch) == 1:
            seq, n = batch[0]
            if seq.num_computed_tokens == 0 and n > 1 and seconds > 0:
                self.profile.observe(n, seconds, blocks=self.num_layers)

    def on_finish(self, seq: Sequence) -> None:
        """Queue the finished request's full chunks (prompt + output) for the store."""
        if self.writer is None:
            return
        C, p = self.chunk, self.engine.block_manager.page_size
        n = min(seq.num_computed_tokens, len(seq.pages) * p) // C * C
        if n == 0:
            return
        ids = seq.token_ids
        for key in chunk_keys(ids[:n], self.keyspace):
            if key.hex in self._known:
                self._known.move_to_end(key.hex)
                continue
            lo = key.index * C
            pids = seq.pages[lo // p:(lo + C) // p]
            layers = [read_chunk_kv(self.engine.runner, i, pids) for i in range(self.num_layers)]
            self.writer.submit(key, ids[lo:lo + C], layers)
            self._remember(key)
            self.stats.chunks_written += 1

    def _remember(self, key: ChunkKey) -> None:
        self._known[key.hex] = None
        if len(self._known) > 100_000:
            self._known.popitem(last=False)

    def bandwidth(self) -> float:
        """Bytes/s the planner assumes: measured loads first, else the emulated link, else a guess."""
        if self.profile.bandwidth is not None:
            return self.profile.bandwidth
        if self.cfg.bandwidth_gbps is not None:
            return gbps(self.cfg.bandwidth_gbps)
        return DEFAULT_BANDWIDTH

    def cost(self) -> BlockCost:
        return BlockCost(self.num_layers, self.bytes_per_token, 0.0, replay_time=self.profile)

    # ---- finding restorable requests ------------------------------------------------------------------
    def _present(self, key: ChunkKey) -> bool:
        if self.writer is not None and self.writer.pending(key):
            self.writer.flush()  # written in a moment: wait rather than recompute it
        return self.store.contains(key, self.num_layers - 1)  # the writer stores layers in order

    def candidate(self, seq: Sequence) -> tuple[list[int], int, int, list[ChunkKey]] | None:
        """(device hits kept, start, cached, chunk keys) when the store holds at least one chunk past the device."""
        if seq.request_id in self._no_restore:
            return None
        bm, C = self.engine.block_manager, self.chunk
        ids = seq.token_ids
        limit = (len(ids) - 1) // C * C  # leave at least one token to compute (the logits)
        hits = bm.match_prefix(seq)
        on_device = len(hits) * bm.page_size
        if limit <= on_device:
            return None
        start = on_device // C * C
        keys = chunk_keys(ids[:limit], self.keyspace)
        self.stats.lookups += 1
        end = start // C
        while end < len(keys) and self._present(keys[end]):
            end += 1
        cached = end * C
        if cached <= on_device:
            return None
        return hits[: start // bm.page_size], start, cached, keys[:end]

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list["RequestOutput"]:
        """Restore what the head of the waiting queue allows; returns their first-token outputs."""
        sch, bm = self.engine.scheduler, self.engine.block_manager
        picked: list[tuple[Sequence, int, int, list[ChunkKey]]] = []
        # Scan past non-restorable requests too: the scheduler admits every waiting request that fits in this
        # same step, so restorable ones behind them would otherwise be prefilled from scratch.
        for seq in list(sch.waiting)[: 4 * self.cfg.max_batch]:
            if len(picked) >= self.cfg.max_batch or len(sch.running) + len(picked) >= sch.config.max_num_seqs:
                break
            cand = self.candidate(seq)
            if cand is None:
                continue
            hits, start, cached, keys = cand
            fresh = max(0, -(-seq.num_tokens // bm.page_size) - len(hits))
            if not bm.can_admit(hits, fresh, reserve=len(sch.running) + len(picked)):
                break
            sch.waiting.remove(seq)
            bm.admit(seq, hits)
            ok = bm.allocate(seq, seq.num_tokens)
            assert ok, "admission check and allocation disagree"
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            picked.append((seq, start, cached, keys))
        if not picked:
            return []
        try:
            return self._restore(picked)
        except Exception:  # noqa: BLE001 - a bug here must cost a recompute, not the requests
            self.stats.errors += 1
            for seq, *_ in reversed(picked):
                bm.release(seq)
                seq.num_computed_tokens = 0
                seq.status = Status.WAITING
                self._no_restore.add(seq.request_id)
                sch.waiting.appendleft(seq)
            return []

    def plan_for(self, picked: list[tuple[Sequence, int, int, list[ChunkKey]]], method: str | None = None) -> Plan:
        reqs = [RestoreRequest(cached - start, seq.num_tokens - cached) for seq, start, cached, _ in picked]
        return make_plan(method or self.cfg.method, reqs, self.cost(), self.bandwidth(), self.chunk)

    def _restore(self, picked: list[tuple[Sequence, int, int, list[ChunkKey]]]) -> list["RequestOutput"]:
        eng = self.engine
        plan = self.plan_for(picked)
        jobs = [RestoreJob(seq.token_ids, start, cached, seq.num_tokens, keys, [start + j for j in js])
                for (seq, start, cached, keys), js in zip(picked, plan.boundaries)]
        seqs = [p[0] for p in picked]
        port = EnginePort(eng.runner, seqs)
        res = RestoreExecutor(port, self.store, self.chunk).run(jobs, profile=self.profile)
        tokens = sample(res.logits, [s.params for s in seqs], [s.generator for s in seqs])
        if eng.runner.store is not None:  # compressed pool: compress the full pages just filled
            p = eng.runner.page_size
            eng.runner.store.compress([pid for seq, start, _, _ in picked for pid in seq.pages[start // p:seq.num_tokens // p]])
        self._account(picked, plan, res)
        outputs = []
        now = time.perf_counter()
        for seq, tok in zip(seqs, tokens):
            seq.num_computed_tokens = seq.num_tokens
            eng.block_manager.commit(seq)
            eng.scheduler.running.append(seq)
            out = eng._append_token(seq, tok, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _account(self, picked: list, plan: Plan, res: RestoreResult) -> None:
        st = self.stats
        st.restorations += 1
        st.requests += len(picked)
        st.restored_tokens += sum(cached - start for _, start, cached, _ in picked)
        st.recomputed_tokens += res.recomputed_tokens
        st.loaded_tokens += res.loaded_tokens
        st.load_failures += len(res.failures)
        st.fallbacks += len(res.fallback_requests)
        st.fallback_tokens += res.fallback_tokens
        bad = {(f.request, f.chunk) for f in res.failures}
        for r, (_, _, _, keys) in enumerate(picked):
            for k in keys:
                if (r, k.index) in bad:  # rewrite it when this request finishes
                    self._known.pop(k.hex, None)
                else:
                    self._remember(k)
        self.history.append(RestoreRecord(
            method=self.cfg.method, cached=[c for _, _, c, _ in picked], suffix=[s.num_tokens - c for s, _, c, _ in picked],
            start=[s for _, s, _, _ in picked], boundaries=plan.boundaries, predicted_seconds=plan.predicted_seconds,
            predicted_compute_seconds=plan.predicted_compute_seconds, predicted_load_seconds=plan.predicted_load_seconds,
            planning_seconds=plan.planning_seconds, total_seconds=res.total_seconds,
            recompute_seconds=res.recompute_seconds, load_seconds=res.load_seconds, wait_seconds=res.wait_seconds,
            suffix_seconds=res.suffix_seconds, load_bytes=res.load_bytes, bandwidth=self.bandwidth(),
            failures=len(res.failures), fallback_tokens=res.fallback_tokens,
            request_ids=[s.request_id for s, *_ in picked]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.store.close()


def make_restorer(engine: "LLMEngine") -> Restorer | None:
    """The engine's restorer, or None when ``EngineConfig.restore`` is not set."""
    return Restorer(engine) if engine.config.restore is not None else None
