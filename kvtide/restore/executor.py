"""Run a restoration plan: recompute a staircase on the compute thread while an I/O thread loads the rest.

For request r and block (= layer) i the plan says j_ri: tokens [start_r, j_ri) are recomputed, [j_ri, N_r)
are loaded from a store (one entry per (chunk, layer)). Order of work, which is what the planner's objective
max(P + L*sigma, Q/B + sigma) assumes (CacheFlow §3.2, appendix A.1):

* I/O thread: layers in order 0..L-1, for each layer every request's chunks from j_ri on; each entry is read,
  verified by the store (checksum, length, token ids), checked for shape, and written into the request's pages
  of that layer. After a layer's last entry it signals that layer (a ``threading.Event``; on CUDA also an
  event recorded on its own stream, which the compute stream waits on, so copies overlap compute).
* compute thread (the caller): first the staircase: the embeddings of [start, j_0) through layer 0, keep the
  rows [start, j_1) of its output for layer 1, and so on (causal attention: recomputed tokens attend only to
  earlier tokens, all recomputed or already on the device); every layer writes its K/V into the pages. Then
  the suffix (the new tokens) layer by layer, each layer as soon as its loads are in; then logits of the last
  suffix row. So compute does P + L*sigma and the last suffix layer waits for all loads (Q/B + sigma).

Failures: any error on an entry (``StoreError`` or anything else the tier raises, also mid-load) marks that
(request, chunk) bad; the request leaves the suffix batch, and after the loads end its tokens from the first
bad position m on are recomputed through every layer as a plain (chunked) prefill over positions
[m, N + Ns): KV below m is complete in every layer (recomputed or verified loads), so this is exactly a
prefill continuation. Garbage never reaches attention; the fallback is counted.

The executor talks to the model through ``ModelPort`` (run one layer over row segments, write K/V of given
positions, logits) so it knows nothing of the engine's scheduler or page tables.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from kvtide.store.base import ChunkCorrupt
from kvtide.store.keys import ChunkKey

__all__ = ["ModelPort", "RestoreExecutor", "RestoreJob", "RestoreResult", "Segment", "LoadFailure"]


@dataclass(frozen=True)
class Segment:
    """Rows of one request in a layer call: positions [start, end) of its sequence, attending over [0, end)."""

    request: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class ModelPort(Protocol):
    """The narrow model interface the executor needs (the engine implements it over its runner)."""

    num_layers: int
    device: torch.device

    def run_layer(self, layer: int, h: torch.Tensor | None, segments: Sequence[Segment]) -> torch.Tensor:
        """Run ``layer`` over the segments' rows (``h`` None: embed their tokens), writing their K/V; returns h."""

    def write_kv(self, layer: int, request: int, start: int, kv: torch.Tensor) -> None:
        """Place ``kv`` [2, T, kv_heads, head_dim] as layer ``layer``'s K/V of positions [start, start+T)."""

    def kv_entry_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) a loaded entry must have."""

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass
class RestoreJob:
    """One request: prefix [0, cached) of which [0, start) is already on the device; suffix [cached, total)."""

    token_ids: Sequence[int]
    start: int
    cached: int
    total: int
    keys: Sequence[ChunkKey]  # chunk keys of the prefix, chunk c covers [c*C, (c+1)*C)
    boundaries: list[int]  # absolute j_i per layer: recompute [start, j_i), load [j_i, cached)

    def validate(self, num_layers: int, chunk: int) -> None:
        if not 0 <= self.start <= self.cached < self.total <= len(self.token_ids):
            raise ValueError(f"need 0 <= start <= cached < total <= len(tokens), got {self.start}, {self.cached}, "
                             f"{self.total}, {len(self.token_ids)} (at least one suffix token to sample)")
        if len(self.boundaries) != num_layers:
            raise ValueError(f"need {num_layers} boundaries, got {len(self.boundaries)}")
        prev = self.cached
        for j in self.boundaries:
            if not self.start <= j <= prev:
                raise ValueError(f"boundaries must be non-increasing within [start, cached]: {self.boundaries}")
            prev = j
        if self.boundaries[-1] < self.cached and len(self.keys) * chunk < self.cached:
            raise ValueError(f"{len(self.keys)} chunk keys do not cover the {self.cached} cached tokens")


@dataclass(frozen=True)
class LoadFailure:
    request: int
    layer: int
    chunk: int
    position: int  # first token of the entry's range that could not be placed
    error: str  # exception class name
    message: str


@dataclass
class RestoreResult:
    """What happened, with the times the latency profile and the benchmarks want."""

    logits: torch.Tensor  # [requests, vocab], last suffix row of each
    total_seconds: float = 0.0
    recompute_seconds: float = 0.0  # staircase (prefix replay) on the compute thread
    suffix_seconds: float = 0.0  # suffix layers, not counting waits
    wait_seconds: float = 0.0  # compute thread idle, waiting for loads
    load_seconds: float = 0.0  # I/O thread: first load start -> last load end
    load_bytes: int = 0
    loaded_entries: int = 0
    recomputed_tokens: int = 0  # sum over (request, layer) of j - start
    loaded_tokens: int = 0  # sum over (request, layer) of tokens placed from the store
    layer_recompute_seconds: list[float] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)
    fallback_requests: list[int] = field(default_factory=list)
    fallback_tokens: int = 0  # positions re-run through every layer by the fallback
    fallback_seconds: float = 0.0


class _Loads:
    """State shared between the compute thread and the I/O thread."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.cuda_events: list[Any] = [None] * num_layers
        self.failures: list[LoadFailure] = []
        self.failed_requests: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t_start = 0.0
        self.t_end = 0.0
        self.bytes = 0
        self.entries = 0
        self.tokens = 0
        self.crash: BaseException | None = None


class RestoreExecutor:
    """Executes staircases on a ``ModelPort`` with a store (anything with ``get_entry(key, layer, tokens)``)."""

    def __init__(self, port: ModelPort, store: Any, chunk: int) -> None:
        if chunk <= 0:
            raise ValueError(f"chunk must be > 0 tokens, got {chunk}")
        self.port = port
        self.store = store
        self.chunk = chunk

    # ------------------------------------------------------------------------------------- I/O side
    def _load_all(self, jobs: Sequence[RestoreJob], st: _Loads) -> None:
        port, C = self.port, self.chunk
        cuda = port.device.type == "cuda"
        stream = torch.cuda.Stream(device=port.device) if cuda else None
        st.t_start = time.perf_counter()
        try:
            with torch.cuda.stream(stream) if cuda else _nullctx():
                for layer in range(port.num_layers):
                    for r, job in enumerate(jobs):
                        lo = job.boundaries[layer]
                        if lo >= job.cached:
                            continue
                        if r in st.failed_requests and _skip_after_failure(st, r):
                            with st.lock:  # not loaded: the fallback must start at or below lo
                                st.failures.append(LoadFailure(r, layer, lo // C, lo, "Skipped", "tier unavailable"))
                            continue
                        for c in range(lo // C, -(-job.cached // C)):
                            if st.stop.is_set():
                                return
                            self._load_one(job, r, layer, c, lo, st)
                    if cuda:
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        st.cuda_events[layer] = ev
                    st.ready[layer].set()
        except BaseException as e:  # never leave the compute thread waiting
            st.crash = e
        finally:
            if cuda:
                stream.synchronize()
            st.t_end = time.perf_counter()
            for ev in st.ready:
                ev.set()

    def _load_one(self, job: RestoreJob, r: int, layer: int, c: int, lo: int, st: _Loads) -> None:
        C = self.chunk
        a, b = max(c * C, lo), min((c + 1) * C, job.cached)
        try:
            key = job.keys[c]
            entry = self.store.get_entry(key, layer, job.token_ids[c * C:(c + 1) * C])
            kv = entry.tensor
            heads, dim = self.port.kv_entry_shape()
            if tuple(kv.shape) != (2, C, heads, dim):
                raise ChunkCorrupt(f"entry {key.entry_name(layer)} has shape {list(kv.shape)}, "
                                   f"expected {[2, C, heads, dim]}", key.entry_name(layer))
            kv = kv[:, a - c * C:b - c * C]
            if self.port.device.type == "cuda":
                kv = kv.pin_memory().to(self.port.device, non_blocking=True)
            self.port.write_kv(layer, r, a, kv)
        except Exception as e:  # noqa: BLE001 - any failure of a tier means "recompute this", never garbage
            with st.lock:
                st.failures.append(LoadFailure(r, layer, c, a, type(e).__name__, str(e)[:200]))
                st.failed_requests.add(r)
            return
        with st.lock:
            st.bytes += entry.nbytes
            st.entries += 1
            st.tokens += b - a

    # --------------------------------------------------------------------------------- compute side
    def run(self, jobs: Sequence[RestoreJob], profile: Any = None) -> RestoreResult:
        """Restore every job's prefix by its boundaries, prefill its suffix, return last-row logits.

        ``profile`` (a LatencyProfile) gets the per-layer recompute times of single-request layers that start
        at position 0 (that is F(j)) and the observed load bandwidth.
        """
        port = self.port
        L = port.num_layers
        for job in jobs:
            job.validate(L, self.chunk)
        cuda = port.device.type == "cuda"
        if cuda:  # page tables and slots the I/O stream reads were made on this stream
            torch.cuda.current_stream(port.device).synchronize()
        t0 = time.perf_counter()
        st = _Loads(L, port.device)
        io = threading.Thread(target=self._load_all, args=(jobs, st), name="kvtide-restore-io", daemon=True)
        io.start()
        res = RestoreResult(logits=torch.empty(0))
        try:
            self._staircase(jobs, res, cuda, profile)
            t_suf = time.perf_counter()
            hs, alive = self._suffix(jobs, st, res, cuda)
            res.suffix_seconds = time.perf_counter() - t_suf - res.wait_seconds
        except BaseException:
            st.stop.set()
            io.join()
            raise
        io.join()
        if st.crash is not None:
            raise RuntimeError("restore I/O thread failed outside a load") from st.crash
        res.failures = list(st.failures)
        res.load_bytes, res.loaded_entries, res.loaded_tokens = st.bytes, st.entries, st.tokens
        res.load_seconds = max(0.0, st.t_end - st.t_start) if any(j.boundaries[-1] < j.cached for j in jobs) else 0.0

        last: dict[int, torch.Tensor] = {}
        if alive:
            ends = torch.tensor(_row_ends([jobs[r].total - jobs[r].cached for r in alive]), device=hs.device) - 1
            for r, row in zip(alive, hs.index_select(0, ends)):
                last[r] = row
        bad = sorted(set(range(len(jobs))) - set(alive))
        if bad:
            last.update(self._fallback(jobs, bad, st.failures, res, cuda))
        rows = torch.stack([last[r] for r in range(len(jobs))])
        res.logits = port.logits(rows)
        if cuda:
            torch.cuda.current_stream(port.device).synchronize()
        res.total_seconds = time.perf_counter() - t0
        if profile is not None and res.load_bytes and res.load_seconds > 0:
            profile.observe_load(res.load_bytes, res.load_seconds)
        return res

    def _staircase(self, jobs: Sequence[RestoreJob], res: RestoreResult, cuda: bool, profile: Any) -> None:
        port = self.port
        h: torch.Tensor | None = None
        prev: list[Segment] = []
        t_all = time.perf_counter()
        for layer in range(port.num_layers):
            segs = [Segment(r, j.start, j.boundaries[layer]) for r, j in enumerate(jobs) if j.boundaries[layer] > j.start]
            if not segs:
                break
            if h is not None:
                h = h.index_select(0, _keep_rows(prev, segs, h.device))
            t = time.perf_counter()
            h = port.run_layer(layer, h, segs)
            if cuda:
                torch.cuda.current_stream(port.device).synchronize()
            dt = time.perf_counter() - t
            res.layer_recompute_seconds.append(dt)
            res.recomputed_tokens += sum(s.length for s in segs)
            if profile is not None and len(segs) == 1 and segs[0].start == 0 and dt > 0:
                profile.observe(segs[0].end, dt)
            prev = segs
        res.recompute_seconds = time.perf_counter() - t_all

    def _suffix(
        self, jobs: Sequence[RestoreJob], st: _Loads, res: RestoreResult, cuda: bool
    ) -> tuple[torch.Tensor | None, list[int]]:
        port = self.port
        alive = list(range(len(jobs)))
        h: torch.Tensor | None = None
        for layer in range(port.num_layers):
            t = time.perf_counter()
            st.ready[layer].wait()
            if cuda and st.cuda_events[layer] is not None:
                torch.cuda.current_stream(port.device).wait_event(st.cuda_events[layer])
            res.wait_seconds += time.perf_counter() - t
            with st.lock:
                failed = set(st.failed_requests)
            if failed & set(alive):
                keep = [r for r in alive if r not in failed]
                if h is not None:
                    old = [Segment(r, jobs[r].cached, jobs[r].total) for r in alive]
                    new = [Segment(r, jobs[r].cached, jobs[r].total) for r in keep]
                    h = h.index_select(0, _keep_rows(old, new, h.device)) if keep else None
                alive = keep
            if not alive:
                return None, []
            h = port.run_layer(layer, h, [Segment(r, jobs[r].cached, jobs[r].total) for r in alive])
        return h, alive

    def _fallback(
        self, jobs: Sequence[RestoreJob], bad: list[int], failures: list[LoadFailure], res: RestoreResult, cuda: bool
    ) -> dict[int, torch.Tensor]:
        """Recompute [m, total) through every layer, m = first position that failed to load."""
        t = time.perf_counter()
        first = {r: min(f.position for f in failures if f.request == r) for r in bad}
        segs = [Segment(r, max(jobs[r].start, first[r]), jobs[r].total) for r in bad]
        h = None
        for layer in range(self.port.num_layers):
            h = self.port.run_layer(layer, h, segs)
        if cuda:
            torch.cuda.current_stream(self.port.device).synchronize()
        ends = torch.tensor(_row_ends([s.length for s in segs]), device=h.device) - 1
        res.fallback_requests = bad
        res.fallback_tokens = sum(s.length for s in segs)
        res.fallback_seconds = time.perf_counter() - t
        return {r: row for r, row in zip(bad, h.index_select(0, ends))}


def _skip_after_failure(st: _Loads, r: int) -> bool:
    """Once a request failed, its later loads are wasted work only if the tier is gone (keep loading otherwise:
    a single corrupt entry should cost only the tokens after it)."""
    with st.lock:
        return any(f.request == r and f.error == "StoreUnavailable" for f in st.failures)


def _row_ends(lengths: Sequence[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        s += n
        out.append(s)
    return out


def _keep_rows(prev: Sequence[Segment], segs: Sequence[Segment], device: torch.device) -> torch.Tensor:
    """Indices of rows of ``prev``'s output that feed ``segs`` (same starts, each end <= its previous end)."""
    off = {}
    o = 0
    for s in prev:
        off[s.request] = o
        o += s.length
    idx = [torch.arange(off[s.request], off[s.request] + s.length) for s in segs]
    return torch.cat(idx).to(device)


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None
