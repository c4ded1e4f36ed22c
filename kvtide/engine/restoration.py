"""Engine wiring of CacheFlow restoration: finished prefixes go to a KV store, waiting requests come back by plan.

At finish (and on eviction, ``spill``) a request's full chunks are copied out of their pages and written by a
background writer. Each step, before the scheduler, the head of the waiting queue is looked up (device prefix-cache
hits first, then store chunks, within ``lookup_budget_s``); requests with chunks to restore are admitted through the
scheduler's admission API, planned together (``method``) and run by the executor, and enter the running set with
their first token sampled. Beside running requests the run advances by a share of each engine step
(``RestoreConfig.step_fraction``) while the others keep decoding; alone it runs to its end at once. Failed loads are
recomputed; a failed restoration sends its requests to plain prefill; an aborted one's pages wait for the run's end.
The engine is reached only through ``RestoreHost``. Details and the reasons: docs/design/engine.md.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from ..config import EngineConfig
from ..log import get_logger, warn_limited
from ..models.llama import CausalLM
from ..restore.costs import BlockCost, ExecutorReplayTime, RestoreRequest
from ..restore.executor import LoadConfig, RestoreExecutor, RestoreJob, RestoreResult, RestoreRun
from ..restore.methods import make_plan
from ..restore.planner import Plan
from ..restore.profile import LatencyProfile
from ..models.fingerprint import config_fingerprint, model_fingerprint
from ..store.auth import RecordAuth, resolve_secret
from ..store.bandwidth import gbps
from ..store.base import StoreUnavailable, encode_record
from ..store.breaker import present
from ..store.factory import open_store
from ..store.keys import ChunkKey, KeySpace, chunk_keys, profile_key
from ..store.writer import StoreWriter
from .block_manager import BlockManager
from .chunk_reader import ChunkReader
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .restore_port import EnginePort
from .restore_profiles import LookupBudgetSpent, StoredProfiles
from .sampler import sample
from .scheduler import Scheduler
from .sequence import Sequence

log = get_logger("restore")


class RestoreHost(Protocol):
    """What a restorer needs of its engine (``LLMEngine`` is one): the model and its runner, the page table and the
    queues, whose public admission API it uses (``BlockManager.cached_pages``, ``Scheduler.admit_restored`` /
    ``run_restored`` / ``requeue_restored``), and the first-token output of a restored request."""

    config: EngineConfig
    model: CausalLM
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler

    def emit_first_token(self, seq: Sequence, token: int, now: float) -> RequestOutput | None: ...

DEFAULT_BANDWIDTH = 2e9  # bytes/s guessed for an unthrottled in-process tier before any load is measured


@dataclass(frozen=True)
class _SpillChunk:
    """A released chunk not yet in the store: its key, tokens and the chained hashes of its pages."""

    key: ChunkKey
    tokens: list[int]
    page_hashes: tuple[bytes, ...]


@dataclass
class RestoreStats:
    restorations: int = 0  # batches run by the executor
    requests: int = 0
    restored_tokens: int = 0  # prefix tokens brought back (recomputed or loaded)
    recomputed_tokens: int = 0  # sum over (request, layer) of recomputed prefix tokens
    loaded_tokens: int = 0  # sum over (request, layer) of loaded prefix tokens
    stolen_tokens: int = 0  # of those, taken over from recompute at run time (stealing)
    load_failures: int = 0  # entries that failed to load (any cause)
    fallbacks: int = 0  # requests whose failed loads were recomputed
    fallback_tokens: int = 0
    errors: int = 0  # restorations abandoned for a plain prefill
    chunks_queued: int = 0  # chunks handed to the writer
    chunks_written: int = 0  # of those, stored whole (every layer entry); a failed write never counts
    write_failures: int = 0  # queued chunks not stored: the tier failed or declined them, or a close deadline passed
    write_seconds: float = 0.0  # step-loop time spent queueing finished chunks for the store (copy-out launched)
    write_wait_seconds: float = 0.0  # step-loop time waiting for queued writes a lookup needed
    writes_dropped: int = 0  # chunks not queued: the writer held RestoreConfig.write_queue_bytes already
    chunks_spilled: int = 0  # of those, written when their device pages were evicted
    spill_missed: int = 0  # evicted chunks that could not be spilled (a page of them was already gone)
    lookups: int = 0
    lookup_failures: int = 0  # lookups the tier did not answer (timeout, down, breaker open): plain prefill
    # requests not looked up (prefilled as usual), and profiles not looked up for a restoration (its lossless
    # entries or another profile's serve it): the step's lookup budget was spent
    lookups_deferred: int = 0
    interleaved_steps: int = 0  # engine steps that advanced a restoration without finishing it (decodes went on)
    profile_requests: int = 0  # of requests, those restored from entries stored under a KVServe profile
    profile_chunks_written: int = 0  # chunks stored under a profile (every layer entry), beside the lossless ones
    profile_write_failures: int = 0


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
    overhead_seconds: float = 0.0  # outside both paths (the model's fixed_seconds learns it)
    link_wait_seconds: float = 0.0  # I/O thread waiting for bytes on the link
    predicted_recompute_seconds: float = 0.0  # P of the plan
    predicted_suffix_seconds: float = 0.0  # sum sigma + suffix call, per block
    predicted_fixed_seconds: float = 0.0
    stolen_tokens: int = 0  # (request, layer) tokens the idle link took over from recompute at run time
    load_batches: int = 0  # store fetches (round trips) the loads took
    planned_load_seconds: float = 0.0  # the plan's own loads, before stealing (what the rate estimate learns)
    planned_load_bytes: int = 0
    layer_recompute_seconds: list[float] = field(default_factory=list)  # per staircase layer (the profile's F data)

    paused_seconds: float = 0.0  # of total_seconds, engine steps run between its quanta (interleaved)
    advances: int = 1  # engine steps it took
    profile: str | None = None  # the KVServe profile whose entries it loaded (None: the lossless entries)
    profile_quality: float = 1.0  # that profile's relative quality (1.0: lossless)
    decode_seconds: float = 0.0  # of load_seconds, decoding the profile's entries

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def timings(self) -> dict[str, Any]:
        """Where its time went, for an API answer (``kv_transfer.restore``): seconds, bytes and fallbacks."""
        return {"method": self.method, "requests": len(self.request_ids), "total_s": self.total_seconds,
                "planning_s": self.planning_seconds, "load_s": self.load_seconds,
                "recompute_s": self.recompute_seconds, "wait_s": self.wait_seconds, "suffix_s": self.suffix_seconds,
                "load_bytes": self.load_bytes, "predicted_s": self.predicted_seconds,
                "paused_s": self.paused_seconds, "advances": self.advances, "fallback_tokens": self.fallback_tokens}


@dataclass
class _Flight:
    """The restoration in flight: its requests (admitted, not running), the plan, the executor's run, and what
    it holds until it ends (the writer's hold)."""

    picked: list
    plan: Plan
    run: RestoreRun
    seqs: list[Sequence]
    stack: contextlib.ExitStack
    profile: str | None = None  # the KVServe profile whose entries it loads (None: lossless)


class Restorer:
    def __init__(self, engine: RestoreHost):
        cfg = engine.config.restore
        assert cfg is not None
        self.engine = engine
        self.cfg = cfg
        a = engine.model.args
        self.num_layers = a.num_layers
        self.chunk = cfg.chunk_tokens
        self.store = open_store(cfg.store, cfg.memory_bytes, cfg.bandwidth_gbps, timeout_s=cfg.store_timeout_s,
                                breaker_failures=cfg.breaker_failures, breaker_backoff_s=cfg.breaker_backoff_s)
        self._unwritten: deque[str] = deque()  # keys of queued chunks the writer did not store (its thread appends)
        self._lookup_seconds = 0.0  # store time of this step's lookups
        self._write_wait_left = 0.0  # what this step may still wait for queued writes a lookup needs
        self._configure_store(self.store)
        self.keyspace = engine_keyspace(engine)
        self.profiles = StoredProfiles(cfg.store_profiles, self.chunk, a.num_layers,
                                       engine.runner.device if engine.runner.device.type == "cuda" else None)
        if self.profiles and engine.config.cache.torch_kv_dtype != torch.bfloat16:
            raise ValueError(f"RestoreConfig.store_profiles needs bfloat16 KV (KVServe pipelines code BF16), the "
                             f"cache holds {engine.config.cache.torch_kv_dtype}")
        self.plan_profile: str | None = None  # the profile the last plan chose (None: lossless)
        # None: each restoration picks (plan_for); "lossless" or a profile's spec: always that one where its entries
        # are held and it serves the requests (benchmarks compare fixed choices with it)
        self.profile_policy: str | None = None
        self._plan_keys: list[list[ChunkKey]] | None = None
        # requests restored from a lossy profile: their KV (and all computed over it) is never stored or cached
        self._tainted: set[str] = set()
        probe = torch.zeros(2, self.chunk, a.num_kv_heads, a.head_dim, dtype=engine.config.cache.torch_kv_dtype)
        key = chunk_keys([0] * self.chunk, self.keyspace)[0]
        record = len(encode_record(key, a.num_layers - 1, [0] * self.chunk, probe,  # exact, padding included
                                   store_token_ids=cfg.store_token_ids))
        self.plain_bytes_per_token = record / self.chunk
        self._written = (0, 0)  # (record bytes, entries) of ZipFusion entries by writers replaced by use_store
        self.profile = LatencyProfile()
        self.plan_bandwidth = self.bandwidth()  # what the last plan assumed (bytes/s)
        self.writer = self._new_writer(self.store)
        if cfg.store_codec is not None and engine.runner.device.type == "cuda":
            _build_zip_kernels(probe.to(engine.runner.device))
        self._reader: ChunkReader | None = None
        self.stats = RestoreStats()
        self.history: deque[RestoreRecord] = deque(maxlen=256)
        self._known: OrderedDict[str, None] = OrderedDict()  # chunk keys written or restored lately
        self._no_restore: set[str] = set()  # request ids sent back to plain prefill
        self._spill: OrderedDict[bytes, _SpillChunk] = OrderedDict()  # page hash -> unwritten chunk it belongs to
        self._flight: _Flight | None = None  # the restoration in flight (one at a time)
        self._not_held: set[int] = set()  # ids of waiting sequences looked up during the flight, not restorable
        self._step_times: deque[float] = deque(maxlen=8)  # recent engine steps' seconds (the interleaving budget)
        if cfg.spill:
            engine.block_manager.on_release = self.on_release
            engine.block_manager.on_evict = self.on_evict

    def use_store(self, store: Any, writes: Any | None = None) -> None:
        """Switch to another store (benchmarks, tests) and forget what the old one held. Finished requests'
        chunks go to `writes` (default: the same store; a bench writes past its emulated link)."""
        if self.writer is not None:
            self.writer.close()
            w = self.writer.stats
            self._written = (self._written[0] + w.zip_bytes, self._written[1] + w.zip_entries)
            for spec, n in w.profile_entries.items():
                self.profiles.observe_written(spec, w.profile_bytes.get(spec, 0), n)
        self._configure_store(store)
        if writes is not None and writes is not store:
            self._configure_store(writes)
        self.writer = self._new_writer(writes if writes is not None else store)
        self.store = store
        self._known.clear()
        self._no_restore.clear()

    @property
    def bytes_per_token(self) -> float:
        """s, stored bytes per token per block (what loads move): exact for plain records (the format's size with
        padding); for ZipFusion records (``store_codec``) the mean of those written so far, since the ratio
        depends on the KV (the plain size until the first is written)."""
        if self.cfg.store_codec is not None:
            w = self.writer
            nbytes = self._written[0] + (w.stats.zip_bytes if w is not None else 0)
            entries = self._written[1] + (w.stats.zip_entries if w is not None else 0)
            if entries and nbytes:
                return nbytes / (entries * self.chunk)
        return self.plain_bytes_per_token

    def _configure_store(self, store: Any) -> None:
        """This config's record settings (secret, token ids) on a store; a disk tier drops chunks missing layers."""
        configure = getattr(store, "configure_records", None)
        if configure is not None:
            configure(self.cfg.secret, self.cfg.store_token_ids)
        prune = getattr(getattr(store, "inner", store), "prune_incomplete", None)
        if prune is not None:
            prune(self.num_layers)

    def _new_writer(self, store: Any) -> StoreWriter | None:
        if not (self.cfg.write_on_finish or self.cfg.spill):
            return None
        return StoreWriter(store, max_bytes=self.cfg.write_queue_bytes, flush_timeout=self.cfg.flush_timeout_s,
                           on_chunk=self._on_chunk)

    def _on_chunk(self, key: ChunkKey, written: bool) -> None:
        """The writer's report (its thread): count the chunk; one not stored is forgotten, to be written again."""
        if key.hex in self.profiles.pending:  # a profile's copy of a chunk: counted apart, never rewritten alone
            self.profiles.pending.discard(key.hex)
            if written:
                self.stats.profile_chunks_written += 1
            else:
                self.stats.profile_write_failures += 1
            return
        if written:
            self.stats.chunks_written += 1
        else:
            self.stats.write_failures += 1
            self._unwritten.append(key.hex)

    def _forget_unwritten(self) -> None:
        while self._unwritten:
            self._known.pop(self._unwritten.popleft(), None)

    # ---- bookkeeping hooks called by the engine ------------------------------------------------------
    def observe_step(self, batch: list[tuple[Sequence, int]], seconds: float) -> None:
        """F(t) from the prefills the engine runs anyway: one sequence, from position 0, t tokens, L blocks; and
        the step's time, which sets the budget of a restoration interleaved with steps (``step_budget``)."""
        if batch and seconds > 0:
            self._step_times.append(seconds)
        if len(batch) == 1:
            seq, n = batch[0]
            if seq.num_computed_tokens == n and n > 1 and seconds > 0:  # the engine has booked the step
                self.profile.observe(n, seconds, blocks=self.num_layers, source="prefill")
                self.profile.knots()  # refit now, off the next plan's clock

    def on_finish(self, seq: Sequence) -> None:
        """Queue the finished request's full chunks (prompt + output) for the store (none of a request restored
        from a lossy profile: its KV is not what a prefill writes, and lossless keys must only hold that)."""
        rid = getattr(seq, "request_id", None)
        if rid in self._tainted:
            self._tainted.discard(rid)
            return
        if self.writer is None or not self.cfg.write_on_finish:
            return
        self._forget_unwritten()
        C, p = self.chunk, self.engine.block_manager.page_size
        n = min(seq.num_computed_tokens, len(seq.pages) * p) // C * C
        if n == 0:
            return
        ids = seq.token_ids
        todo = []
        for key in chunk_keys(ids[:n], self.keyspace):
            if key.hex in self._known:
                self._known.move_to_end(key.hex)
                continue
            lo = key.index * C
            todo.append((key, ids[lo:lo + C], seq.pages[lo // p:(lo + C) // p]))
        self._write(todo)

    def _write(self, todo: list[tuple[ChunkKey, list[int], list[int]]]) -> None:
        """Copy chunks (key, tokens, page ids) out of their pages, one device read per layer, and queue them."""
        if not todo:
            return
        pids = [pid for _, _, ps in todo for pid in ps]
        a = self.engine.model.args
        nbytes = (self.num_layers * 2 * len(pids) * self.engine.block_manager.page_size * a.num_kv_heads * a.head_dim
                  * self.engine.config.cache.torch_kv_dtype.itemsize)
        if not self.writer.admit(nbytes):
            self.stats.writes_dropped += len(todo)
            warn_limited(log, "restore-write-dropped", "store writer full (write_queue_bytes): %d finished chunks "
                         "not written (%d so far)", len(todo), self.stats.writes_dropped)
            return
        t0 = time.perf_counter()
        if self._reader is None:
            self._reader = ChunkReader(self.engine.runner)
        C = self.chunk
        read = self._reader.read_zip if self.cfg.store_codec is not None else self._reader.read
        per_chunk, ready = read(pids, C)
        plain = per_chunk
        if self.profiles and self.cfg.store_codec is not None:  # profiles encode the plain KV
            plain, ready_plain = self._reader.read(pids, C)
        for k, (key, toks, _) in enumerate(todo):
            self.writer.submit(key, toks, per_chunk[k], ready)
            self._remember(key)
            self.stats.chunks_queued += 1
            for prof in self.profiles.profiles:  # after the lossless entry: a lookup finds that first
                pkey = profile_key(key, prof.spec)
                self.profiles.pending.add(pkey.hex)
                self.writer.submit(pkey, toks, self.profiles.pending_layers(prof.spec, plain[k]),
                                   ready if plain is per_chunk else ready_plain)
        self.stats.write_seconds += time.perf_counter() - t0

    # ---- spill on evict ----------------------------------------------------------------------------------
    def on_release(self, seq: Sequence) -> None:
        """Remember the releasing sequence's committed chunks that the store does not hold yet."""
        bm, C = self.engine.block_manager, self.chunk
        hashes = bm.committed_hashes(seq)
        p = bm.page_size
        n = len(hashes) * p // C * C
        if self.writer is None or n == 0:
            return
        self._forget_unwritten()
        ids = seq.token_ids
        for key in chunk_keys(ids[:n], self.keyspace):
            if key.hex in self._known:
                continue
            lo = key.index * C
            info = _SpillChunk(key, list(ids[lo:lo + C]), tuple(hashes[lo // p:(lo + C) // p]))
            for h in info.page_hashes:
                self._spill[h] = info
                self._spill.move_to_end(h)
        while len(self._spill) > 200_000:
            self._spill.popitem(last=False)

    def on_evict(self, pids: list[int]) -> None:
        """Write each unwritten chunk a page of which is about to be evicted (all its pages must be intact)."""
        bm = self.engine.block_manager
        todo = []
        for pid in pids:
            info = self._spill.pop(bm.hash_of(pid), None)
            if info is None or info.key.hex in self._known:
                continue
            chunk_pids = bm.cached_pages(info.page_hashes, info.tokens)
            for h in info.page_hashes:
                self._spill.pop(h, None)
            if chunk_pids is None:
                self.stats.spill_missed += 1
                continue
            todo.append((info.key, info.tokens, chunk_pids))
        if todo:
            self._write(todo)
            self.stats.chunks_spilled += len(todo)

    def _remember(self, key: ChunkKey) -> None:
        self._known[key.hex] = None
        if len(self._known) > 100_000:
            self._known.popitem(last=False)

    def bandwidth(self, method: str | None = None) -> float:
        """Bytes/s the planner assumes: the least of what is known of the load's rate. Measured loads over this
        link (those that ran beside a replay, except for a load-only plan, which has none beside it); the emulated
        link's rate; the measured rate of the load path of this tier and codec (learned across link changes: a link
        faster than the path cannot make the loads faster, so a plan never assumes more); else a guess."""
        overlapped = (method or self.cfg.method) != "load"
        known = [self.profile.bandwidth_for(overlapped), self.profile.path_bandwidth_for(self.tier, overlapped)]
        if self.cfg.bandwidth_gbps is not None:
            known.append(gbps(self.cfg.bandwidth_gbps))
        known = [x for x in known if x is not None]
        return min(known) if known else DEFAULT_BANDWIDTH

    @property
    def tier(self) -> str:
        """The load path's identity for its rate estimate: the innermost store's kind and the entries' codec
        (wrappers such as an emulated link or a breaker do not change the path)."""
        s = self.store
        while hasattr(s, "inner"):
            s = s.inner
        return f"{type(s).__name__}/{self.cfg.store_codec or 'plain'}"

    def replay_time(self, batch: int = 1, scaled: bool = True, tokens: int | None = None) -> ExecutorReplayTime:
        """F as the executor pays it for a batch (shared layer calls; measured/modelled compute scale). ``tokens``:
        the longest request's prefix, where the shared part of a call is read off F (``call_overhead_at``)."""
        p = self.profile
        shared = p.call_overhead if tokens is None else p.call_overhead_at(tokens)
        return ExecutorReplayTime(p, shared, batch, p.compute_scale_for(batch) if scaled else 1.0)

    def cost(self, batch: int = 1, tokens: int | None = None) -> BlockCost:
        p = self.profile
        return BlockCost(self.num_layers, self.bytes_per_token, 0.0, replay_time=self.replay_time(batch, tokens=tokens),
                         suffix_overhead=p.suffix_overhead, fixed_seconds=p.fixed_overhead,
                         suffix_scale=p.suffix_scale)

    # ---- finding restorable requests ------------------------------------------------------------------
    def _present(self, key: ChunkKey) -> bool:
        """Whether the store holds the chunk (its last layer: the writer stores layers in order); StoreUnavailable
        when the tier gives no answer. Its time counts against the step's lookup budget."""
        t0 = time.perf_counter()
        try:
            return present(self.store, key, self.num_layers - 1)
        finally:
            self._lookup_seconds += time.perf_counter() - t0

    def _budget_spent(self) -> bool:
        budget = self.cfg.lookup_budget_s
        return budget is not None and self._lookup_seconds >= budget

    def _write_needed(self, keys: list[ChunkKey]) -> None:
        """Chunks of this prefix still queued for the store (a request that finished moments ago) are written
        first and waited for, only those: written in a moment, rather than recomputed; the rest of the queue
        stays behind them. Only the run of chunks a lookup can reach (present or queued) is waited for, and a step
        waits at most ``store_timeout_s`` in all (a slow tier's writes are not waited out: those chunks miss)."""
        if self.writer is None or not self.writer.has_pending() or self._write_wait_left <= 0:
            return
        want = []
        for k in keys:
            if self.writer.pending(k):
                want.append(k)
            elif self._budget_spent() or not self._present(k):
                break
        if want:
            t0 = time.perf_counter()
            self.writer.wait_for(want, timeout=self._write_wait_left)
            dt = time.perf_counter() - t0
            self._write_wait_left -= dt
            self.stats.write_wait_seconds += dt

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
        try:
            self._write_needed(keys[end:])
            # past the budget, the chunks found so far are restored
            missed = False
            while end < len(keys) and not self._budget_spent():
                if not self._present(keys[end]):
                    missed = True
                    break
                end += 1
        except StoreUnavailable:  # no answer (timed out, down, breaker open): plain prefill
            self.stats.lookup_failures += 1
            return None
        if missed:  # the tier lost what we wrote (evicted, expired, a restarted Redis): write these chunks again
            for k in keys[end:]:
                self._known.pop(k.hex, None)
        cached = end * C
        if cached <= on_device:
            return None
        return hits[: start // bm.page_size], start, cached, keys[:end]

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance the restoration in flight, or start one with what the head of the waiting queue allows;
        returns the first-token outputs of a restoration that completed in this step."""
        if self._flight is None:
            self._flight = self._start(self._pick())
            if self._flight is None:
                return []
        else:
            self._hold()
        f = self._flight
        try:
            done = f.run.advance(self.step_budget())
        except Exception:  # noqa: BLE001 - a bug here must cost a recompute, not the requests
            log.exception("restoration failed; its requests are prefilled instead")
            self._abandon(f)
            return []
        if not done:
            self.stats.interleaved_steps += 1
            return []
        self._flight = None
        f.stack.close()
        try:
            return self._complete(f)
        except Exception:  # noqa: BLE001
            log.exception("restoration failed after its run; its requests are prefilled instead")
            self._abandon(f, ran=True)
            return []

    def _hold(self) -> None:
        """While a restoration is in flight, waiting requests whose prefix it could restore are held back from plain
        prefill (``Scheduler.held``) for the next restoration; each is looked up once."""
        sch = self.engine.scheduler
        self._lookup_seconds, self._write_wait_left = 0.0, 0.0
        for seq in sch.waiting_head(4 * self.cfg.max_batch):
            if id(seq) in sch.held or id(seq) in self._not_held or self._budget_spent():
                continue
            if self.candidate(seq) is not None:
                sch.held.add(id(seq))
            else:
                self._not_held.add(id(seq))

    def _pick(self) -> list[tuple[Sequence, int, int, list[ChunkKey]]]:
        sch = self.engine.scheduler
        sch.held.clear()
        self._not_held.clear()
        picked: list[tuple[Sequence, int, int, list[ChunkKey]]] = []
        self._lookup_seconds, self._write_wait_left = 0.0, self.cfg.store_timeout_s
        room = sch.seq_slots_left()
        # Scan past non-restorable requests too: the scheduler admits every waiting request that fits in this
        # same step, so restorable ones behind them would otherwise be prefilled from scratch.
        for seq in sch.waiting_head(4 * self.cfg.max_batch):
            if len(picked) >= self.cfg.max_batch or len(picked) >= room:
                break
            if self._budget_spent():  # left to the scheduler: prefilled now if it fits, else looked up next step
                self.stats.lookups_deferred += 1
                continue
            cand = self.candidate(seq)
            if cand is None:
                continue
            hits, start, cached, keys = cand
            if not sch.admit_restored(seq, hits, cached, pending=len(picked)):
                break
            picked.append((seq, start, cached, keys))
        return picked

    def step_budget(self) -> float:
        """Seconds of restoration work this step: all of it when nothing else runs (or ``step_fraction`` is None:
        the blocking restoration), else ``step_fraction`` of the median recent engine step (0 before one is
        measured: one quantum a step)."""
        frac = self.cfg.step_fraction
        if frac is None or not self.engine.scheduler.running:
            return math.inf
        if not self._step_times:
            return 0.0
        return frac * float(np.median(self._step_times))

    def compute_share(self) -> float:
        """The part of the wall clock a restoration started now gets for its compute: 1 alone, else
        f / (1 + f) with f = ``step_fraction`` (the rest is the decode steps it runs beside)."""
        frac = self.cfg.step_fraction
        if frac is None or not self.engine.scheduler.running:
            return 1.0
        return frac / (1.0 + frac)

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is being restored (its pages are being written: not to be released by anyone else)."""
        return self._flight is not None and any(s is seq for s in self._flight.seqs)

    def abort(self, seq: Sequence) -> None:
        """An aborted request of the restoration in flight (already marked finished by the engine): its pages are
        released when the restoration ends, since the I/O thread may be writing them; the last one aborted stops
        the restoration now (the I/O thread joined first)."""
        f = self._flight
        assert f is not None and self.holds(seq)
        if all(s.finished for s in f.seqs):
            self._flight = None
            f.run.cancel()
            f.stack.close()
            for s in f.seqs:
                self.engine.scheduler.finish(s)

    def _start(self, picked: list[tuple[Sequence, int, int, list[ChunkKey]]]) -> "_Flight | None":
        if not picked:
            return None
        eng = self.engine
        stack = contextlib.ExitStack()
        try:
            # The writer holds from the plan on: planning is on the request's critical path like the executor's
            # threads, and an entry being encoded holds the GIL for part of its copies and hash.
            if self.writer is not None:
                stack.enter_context(self.writer.held())
            plan = self.plan_for(picked)
            keys_of = self._plan_keys or [keys for *_, keys in picked]
            jobs = [RestoreJob(seq.token_ids, start, cached, seq.num_tokens, keys, [start + j for j in js],
                               profile=self.plan_profile)
                    for (seq, start, cached, _), keys, js in zip(picked, keys_of, plan.boundaries)]
            seqs = [p[0] for p in picked]
            port = EnginePort(eng.runner, seqs)
            # Stealing (the idle link takes recompute chunks when compute runs slower than planned) for every plan
            # that mixes the two; recompute-only keeps its link idle by definition, load-only has nothing to take.
            steal = self.cfg.steal and plan.method not in ("recompute-only", "load-only")
            load = LoadConfig(steal=steal, merge_layers=self.cfg.merge_load_layers, workers=self.cfg.load_workers,
                              read_ahead=self.cfg.load_read_ahead)
            ex = RestoreExecutor(port, self.store, self.chunk, load, kv_dtype=eng.config.cache.torch_kv_dtype)
            run = ex.start(jobs, profile=self.profile, quantum_cost=self._quantum_cost(len(picked)))
        except Exception:  # noqa: BLE001 - a bug here must cost a recompute, not the requests
            log.exception("restoration could not start; its requests are prefilled instead")
            stack.close()
            self.stats.errors += 1
            for seq, *_ in reversed(picked):
                self._no_restore.add(seq.request_id)
                eng.scheduler.requeue_restored(seq)
            return None
        return _Flight(picked, plan, run, seqs, stack, self.plan_profile)

    def _quantum_cost(self, batch: int):  # noqa: ANN202
        """Predicted seconds of one layer call over segments (F as the executor pays it, per request's rows)."""
        F = self.replay_time(batch)

        def cost(segs) -> float:  # noqa: ANN001
            return float(sum(F(s.end) - F(s.start) if s.start else F(s.end) for s in segs))
        return cost

    def _abandon(self, f: "_Flight", ran: bool = False) -> None:
        """A restoration that failed as a whole: stopped (loads joined), its live requests back to plain prefill,
        the aborted ones released."""
        self.stats.errors += 1
        if self._flight is f:
            self._flight = None
        if not ran:
            with contextlib.suppress(Exception):
                f.run.cancel()
        f.stack.close()
        sch = self.engine.scheduler
        for seq in reversed(f.seqs):
            if seq.finished:
                sch.finish(seq)
            else:
                self._no_restore.add(seq.request_id)
                sch.requeue_restored(seq)

    def plan_for(self, picked: list[tuple[Sequence, int, int, list[ChunkKey]]], method: str | None = None) -> Plan:
        """The plan to run. CacheFlow with stealing on plans ``hedge`` compute-heavy (as if replay were that much
        cheaper) and predicts with the unbiased optimum: stealing only moves work from compute to the link, so a
        plan that leaves the link slack absorbs a compute thread slower than predicted, and when it is not
        slower, the idle link takes the surplus back at run time (ending near the unbiased optimum). A restoration
        that will run beside decode steps prices its compute at 1 / ``compute_share`` of the profile's (its quanta
        get that part of the wall clock), so it loads more."""
        method = method or self.cfg.method
        reqs = [RestoreRequest(cached - start, seq.num_tokens - cached) for seq, start, cached, _ in picked]
        self.plan_bandwidth = bw = self.bandwidth(method)
        longest = max(r.cached_tokens for r in reqs)
        cost = self.cost(len(reqs), longest)
        share = self.compute_share()
        if share < 1.0:  # interleaved with decode steps: its compute gets this part of the wall clock, loads all
            cost = replace(cost, replay_time=replace(cost.replay_time, scale=cost.replay_time.scale / share),
                           suffix_overhead=cost.suffix_overhead / share)
        best, cost = self._choose_profile(picked, method, reqs, cost, bw)
        if method != "cacheflow" or not self.cfg.steal or self.cfg.hedge == 0.0:
            return best
        rt = replace(cost.replay_time, scale=cost.replay_time.scale * (1.0 - self.cfg.hedge))
        hedged = make_plan(method, reqs, replace(cost, replay_time=rt), bw, self.chunk)
        best.boundaries = hedged.boundaries
        best.planning_seconds += hedged.planning_seconds
        best.method = "cacheflow-hedged"
        return best

    def _choose_profile(self, picked: list, method: str, reqs: list[RestoreRequest], cost: BlockCost, bw: float
                        ) -> tuple[Plan, BlockCost]:
        """The joint restore x compress plan: the lossless entries' plan, or, among the profiles serving every
        request's ``kv_min_quality`` whose entries the store holds, the one whose plan predicts the least time,
        priced at its bytes per token and decode seconds per token (``profile_policy`` can fix the choice).
        Sets ``plan_profile`` and ``_plan_keys`` (the chosen entries' keys; None: the lossless ones)."""
        self.plan_profile, self._plan_keys = None, None
        best = make_plan(method, reqs, cost, bw, self.chunk)
        policy = self.profile_policy
        if not self.profiles or method == "recompute" or policy == "lossless":
            return best, cost
        if policy is not None:  # profiles are kept by their canonical spec
            policy = self.profiles.canonical(policy)
        qmin = min(seq.params.kv_min_quality for seq, *_ in picked)
        for prof in self.profiles.eligible(qmin):
            if policy is not None and prof.spec != policy:
                continue
            try:
                keys = self.profiles.held(self._present, prof.spec,
                                          [(k, start, cached) for _, start, cached, k in picked], self._budget_spent)
            except LookupBudgetSpent:  # the step's lookup budget is gone: this profile is not used now
                self.stats.lookups_deferred += 1
                continue
            if keys is None:
                continue
            w = self.writer.stats if self.writer is not None else None
            written = (w.profile_bytes.get(prof.spec, 0), w.profile_entries.get(prof.spec, 0)) if w else (0, 0)
            pc = replace(cost, kv_bytes_per_token=self.profiles.bytes_per_token(prof.spec, written,
                                                                                  self.plain_bytes_per_token),
                         decode_seconds_per_token=self.profiles.decode_seconds_per_token(prof.spec))
            cand = make_plan(method, reqs, pc, bw, self.chunk)
            if policy is not None or cand.predicted_seconds < best.predicted_seconds:
                best, cost, self.plan_profile, self._plan_keys = cand, pc, prof.spec, keys
        return best, cost

    def _complete(self, f: "_Flight") -> list[RequestOutput]:
        """A finished run: learn from it, sample first tokens, and start its live requests (aborted ones released)."""
        eng = self.engine
        picked, plan, res, seqs = f.picked, f.plan, f.run.result(), f.seqs
        self._learn_overheads(picked, res)
        if f.profile is not None:
            self.profiles.observe_loaded(f.profile, res.load_bytes, res.loaded_entries, res.decode_seconds,
                                         res.decoded_entries)
        elif res.load_bytes and res.load_seconds > res.link_wait_seconds:  # the tier's own entries: its path rate
            self.profile.observe_path(self.tier, res.load_bytes, res.load_seconds - res.link_wait_seconds,
                                      overlapped=res.recompute_seconds > 0)
        tokens = sample(res.logits, [s.params for s in seqs], [s.generator for s in seqs])
        if eng.runner.pool is not None:  # compressed pool: compress the full pages just filled
            p = eng.runner.page_size
            eng.runner.pool.compress([pid for seq, start, _, _ in picked for pid in seq.pages[start // p:seq.num_tokens // p]])
        self._account(picked, plan, res, f.profile)
        outputs = []
        now = time.perf_counter()
        for seq, tok in zip(seqs, tokens):
            if seq.finished:  # aborted while it was restored
                eng.scheduler.finish(seq)
                continue
            if f.profile is not None and not self.profiles.get(f.profile).lossless:
                self._tainted.add(seq.request_id)
                eng.block_manager.uncacheable.add(seq.request_id)
            eng.scheduler.run_restored(seq)
            out = eng.emit_first_token(seq, tok, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _learn_overheads(self, picked: list, res: RestoreResult) -> None:
        """Compute scale, suffix-call and fixed overheads for the cost model, from clean runs (no fallback)."""
        if res.fallback_requests or not res.suffix_layer_seconds:
            return
        prof, n = self.profile, len(picked)
        prof.knots()  # the executor's layer times changed F: refit now, off the next plan's clock
        longest = max(cached - start for _, start, cached, _ in picked)
        G = self.replay_time(n, scaled=False, tokens=longest)
        executed = [[b - start for b in bs] for bs, (_, start, _, _) in zip(res.boundaries, picked)]
        modelled = float(sum(G(np.asarray(js)).sum() for js in executed))
        if modelled > 0.05 * res.total_seconds:  # enough staircase to say something
            prof.observe_compute(res.recompute_seconds, modelled, batch=n)
        F = self.replay_time(n, tokens=longest)
        sigma = sum(float(F(seq.num_tokens - start)) - float(F(cached - start)) for seq, start, cached, _ in picked)
        # On CUDA a suffix layer whose loads were not in when the compute thread reached it was launched just in
        # time, and its device-timed span holds the host's launch gaps (several times a back-to-back layer's
        # time). The compute side of the plan runs its suffix layers back to back: learn their
        # cost from the others. (On the CPU a layer's time is its wall time either way.)
        times = res.suffix_layer_seconds
        if self.engine.runner.device.type == "cuda":
            times = [t for t, paced in zip(times, res.suffix_layer_paced) if not paced]
        if times:
            prof.observe_suffix(sum(times) / len(times), sigma)
        prof.observe_overhead(res.overhead_seconds)

    def _account(self, picked: list, plan: Plan, res: RestoreResult, profile: str | None = None) -> None:
        st = self.stats
        st.restorations += 1
        st.profile_requests += len(picked) if profile is not None else 0
        st.requests += len(picked)
        st.restored_tokens += sum(cached - start for _, start, cached, _ in picked)
        st.recomputed_tokens += res.recomputed_tokens
        st.loaded_tokens += res.loaded_tokens
        st.stolen_tokens += res.stolen_tokens
        st.load_failures += len(res.failures)
        st.fallbacks += len(res.fallback_requests)
        st.fallback_tokens += res.fallback_tokens
        if res.failures or res.fallback_requests:
            warn_limited(log, "restore-fallback", "restoration: %d chunk loads failed, %d requests recomputed %d "
                         "tokens instead (%s)", len(res.failures), len(res.fallback_requests), res.fallback_tokens,
                         ", ".join(sorted({f.error for f in res.failures})) or "no loads failed")
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
            suffix_seconds=res.suffix_seconds, load_bytes=res.load_bytes, bandwidth=self.plan_bandwidth,
            failures=len(res.failures), fallback_tokens=res.fallback_tokens,
            request_ids=[s.request_id for s, *_ in picked], overhead_seconds=res.overhead_seconds,
            link_wait_seconds=res.link_wait_seconds, predicted_recompute_seconds=plan.recompute_seconds,
            predicted_suffix_seconds=(plan.predicted_load_seconds - plan.load_bytes / self.plan_bandwidth),
            predicted_fixed_seconds=plan.predicted_seconds - max(plan.predicted_compute_seconds,
                                                                 plan.predicted_load_seconds),
            stolen_tokens=res.stolen_tokens, load_batches=res.load_batches,
            planned_load_seconds=res.planned_load_seconds, planned_load_bytes=res.planned_load_bytes,
            layer_recompute_seconds=list(res.layer_recompute_seconds), paused_seconds=res.paused_seconds,
            advances=res.advances, profile=profile,
            profile_quality=self.profiles.get(profile).quality if profile is not None else 1.0,
            decode_seconds=res.decode_seconds))

    def record_of(self, request_ids: list[str]) -> RestoreRecord | None:
        """The latest kept restoration that served one of ``request_ids`` (any thread; None: none kept)."""
        ids = set(request_ids)
        for _ in range(3):  # the engine thread appends meanwhile: a copy can meet a mutation
            try:
                recs = list(self.history)
                break
            except RuntimeError:
                continue
        else:
            return None
        return next((r for r in reversed(recs) if ids.intersection(r.request_ids)), None)

    def close(self) -> None:
        f, self._flight = self._flight, None
        if f is not None:  # the loads stop and are joined before the store closes
            with contextlib.suppress(Exception):
                f.run.cancel()
            f.stack.close()
        if self.writer is not None:
            self.writer.close()
        self.store.close()


def _build_zip_kernels(kv: torch.Tensor) -> None:
    """Compile the Triton encode and decode kernels of ZipFusion entries now, not inside the first restoration's
    loads or the first finished request's write (a JIT build takes seconds)."""
    from ..cache import zip_blocks
    from ..kernels import zip_unpack
    from ..store.zip_entry import BLOCK_SIZE, encode_entries

    desc, slots = encode_entries(kv.reshape(1, -1), tuple(kv.shape))
    sizes = zip_blocks.block_sizes(desc, BLOCK_SIZE)
    zip_unpack.unpack(slots.reshape(-1), desc, sizes.cumsum(1) - sizes, BLOCK_SIZE)
    torch.cuda.synchronize(kv.device)


def engine_keyspace(engine: RestoreHost) -> KeySpace:
    """The keys' root for this engine's KV: model and shapes, the weights' content, the model config, the compute
    and KV dtypes, the chunk size, ``RestoreConfig.namespace`` and the store secret's salt (``kvtide.store.keys``)."""
    cfg, a = engine.config.restore, engine.model.args
    secret = resolve_secret(cfg.secret)
    return KeySpace(
        f"{engine.config.model}|{a.num_layers}x{a.hidden_size}x{a.num_kv_heads}x{a.head_dim}", cfg.chunk_tokens,
        _dtype_name(engine.config.cache.torch_kv_dtype), weights=model_fingerprint(engine.model),
        model_config=config_fingerprint(a), compute_dtype=_dtype_name(next(engine.model.parameters()).dtype),
        namespace=cfg.namespace, salt=RecordAuth(secret).key_salt if secret is not None else b"")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def make_restorer(engine: RestoreHost) -> Restorer | None:
    """The engine's restorer, or None when ``EngineConfig.restore`` is not set."""
    return Restorer(engine) if engine.config.restore is not None else None
